"""The artifact on disk: capsules, ``artifact.json``, residual blobs, overlays, seeds, level-1 sleep capsules."""
