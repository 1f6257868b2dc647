"""The node-local, content-addressed payload cache: the object store and its one admission door,
validation records, the per-digest locks, writes in progress, and gc."""
