"""The artifact on disk: capsules and ``artifact.json``, residual blobs, target-local overlays, level-1
sleep capsules."""
