"""Capture: the write observer and its bookkeeping, the payload planner, the canonical pack writer,
capturing a worker, and rebuilding a pack from resident bytes (materialize)."""
