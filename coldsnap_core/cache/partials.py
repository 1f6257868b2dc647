"""Writes in progress in ``tmp/``: ``flock``-held ``.partial`` files; dead writers' swept (``docs/format.md`` §10)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import time
from pathlib import Path

from coldsnap_core._io import remove_tree

logger = logging.getLogger(__name__)


TEMP_SUFFIX = ".partial"
DOWNLOAD_DIR_SUFFIX = ".partial.d"


def list_folder(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except FileNotFoundError:
        return []


def lock_is_free(path: Path, operation: int = fcntl.LOCK_EX) -> bool:
    """Whether a fresh open of ``path`` (no link followed, non-blocking) can take ``flock(operation)`` on it now;
    ``OSError`` (``FileNotFoundError`` included) when it cannot be opened, or ``flock`` fails other than by being held."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def writer_gone(path: Path) -> bool:
    """True if nobody holds ``flock`` on ``path``; ``False`` if the file is gone already."""
    try:
        return lock_is_free(path)
    except FileNotFoundError:
        return False


SWEEP_GRACE_SECONDS = 10.0
"""A writer's sweep leaves a ``.partial`` modified less recently (a new writer creates its file, then locks it)."""


def create_locked_partial(path: Path) -> int:
    """Create ``path`` (``O_EXCL | O_NOFOLLOW``, mode 0600, for writing), hold ``flock`` on it, return the fd (or OSError)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file (O_EXCL): nobody else holds it
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return fd


def _flock_works(path: Path) -> bool:
    """Whether ``flock`` excludes here (a second open of ``path``, which this process holds locked, cannot lock it;
    on Lustre, GPFS and some NFS mounts it is a no-op)."""
    try:
        return not lock_is_free(path)
    except OSError:
        return False


def sweep_dead_partials(tmp_dir: Path, own_path: Path) -> list[Path]:
    """Remove the dead writers' ``*.partial`` of ``tmp_dir`` (``docs/format.md`` §10, "Temporaries"); called by each
    new writer, which holds ``own_path`` locked. Best effort; returns the removed paths."""
    if not _flock_works(own_path):
        return []
    removed = []
    now = time.time()
    for path in list_folder(tmp_dir):
        if path == own_path or not path.name.endswith(TEMP_SUFFIX):
            continue
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < SWEEP_GRACE_SECONDS or not writer_gone(path):
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
        remove_tree(path.with_name(path.name + ".d"))
    if removed:
        logger.info("coldsnap: removed %d temporary file(s) whose writer is gone: %s", len(removed), ", ".join(map(str, removed)))
    return removed


def tree_size(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        return 0
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
