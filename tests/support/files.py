"""File edits the tests use to produce corruption (one flipped byte of a read-only pack or blob), and a
command prefix under which file modes are enforced even for root."""

from __future__ import annotations

import os
import shutil
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


def permissions_enforced(command: list[str]) -> list[str]:
    """``command`` as it must run for a mode-000 file to give ``EACCES``: unchanged for a user; for root
    (CI runs as root), under ``setpriv`` with ``CAP_DAC_OVERRIDE`` and ``CAP_DAC_READ_SEARCH`` dropped
    from the bounding and inheritable sets, so the new process checks file modes like any user.
    Raises ``AssertionError`` when root has no ``setpriv`` (util-linux)."""
    if os.geteuid() != 0:
        return command
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to drop CAP_DAC_OVERRIDE for this check"
    drop = "-dac_override,-dac_read_search"
    return [setpriv, f"--bounding-set={drop}", f"--inh-caps={drop}", *command]
