"""The node-local, content-addressed payload cache (``docs/format.md`` §10, §11)."""
