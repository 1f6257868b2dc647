"""Capture: the write observer, the payload planner and pack writer, and every capture built on them."""
