"""File edits the tests use to produce corruption: one flipped byte of a read-only pack or blob."""

from __future__ import annotations

import os
from pathlib import Path


def flip_byte(path: Path, offset: int) -> None:
    """XOR the byte at ``offset`` of ``path`` with 0x01 (the smallest change a digest must notice);
    the file is made writable for the edit and left read-only (mode 0444), as the cache keeps packs."""
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0x01]))
    os.chmod(path, 0o444)
