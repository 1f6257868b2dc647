"""Restore: staging a pack from a store, hydrating allocations from an admitted pack, the linear restore
pipeline (restore or fall back), and the artifact audit."""
