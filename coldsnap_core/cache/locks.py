"""The payload cache's per-digest lock plumbing: re-entrancy, logged waits, the holder (``docs/format.md`` §10, "Lock waits")."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import filelock

from coldsnap_core.settings import LOCK_TIMEOUT_ENV

logger = logging.getLogger(__name__)


LOCK_NOTICE_SECONDS = 5.0
"""A wait for a lock longer than this is logged at INFO, and again every :data:`LOCK_NOTICE_REPEAT_SECONDS`."""
LOCK_NOTICE_REPEAT_SECONDS = 30.0

_held = threading.local()


def held_locks() -> set[tuple[int, str]]:
    held = getattr(_held, "locks", None)
    if held is None:
        held = _held.locks = set()
    return held


def acquire_logged(lock: filelock.BaseFileLock, path: Path, timeout: float) -> None:
    """``lock.acquire(timeout)``, logging at INFO while the wait is long. The lock file is created first (with the
    lock's mode): ``filelock`` retries a create that fails with ``ENOENT`` until the timeout. ``filelock.Timeout``
    when not had within ``timeout`` seconds (``< 0``: for ever); ``OSError`` at once when the file cannot be opened."""
    if not os.path.lexists(path):
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, getattr(lock, "mode", 0o644)))
    started = time.monotonic()
    notice = LOCK_NOTICE_SECONDS
    while True:
        waited = time.monotonic() - started
        remaining = float("inf") if timeout < 0 else timeout - waited
        step = min(remaining, max(notice - waited, 0.0))
        try:
            lock.acquire(timeout=max(step, 0.0))
            return
        except filelock.Timeout:
            waited = time.monotonic() - started
            if timeout >= 0 and waited >= timeout:
                raise
            if waited >= notice:
                logger.info(
                    "coldsnap: waiting for %s (holder: %s) for %.0f s so far, up to %s (%s)",
                    path,
                    describe_holder(path),
                    waited,
                    "no limit" if timeout < 0 else f"{timeout:g} s",
                    LOCK_TIMEOUT_ENV,
                )
                notice = waited + LOCK_NOTICE_REPEAT_SECONDS


def describe_holder(lock_path: Path) -> str:
    """``pid N on host H`` of the process holding ``flock`` on ``lock_path``, from the kernel's lock table
    (``/proc/locks``, by device and inode), or ``unknown`` (no ``/proc``, another PID namespace or host)."""
    import socket

    try:
        st = os.stat(lock_path)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            table = f.read()
    except OSError:
        return "unknown"
    wanted = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in table.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 fd:01:1234 0 EOF"; "->" marks a waiter, not a holder.
        if len(fields) < 6 or fields[1] == "->" or fields[1] != "FLOCK":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
            pid = int(fields[4])
        except ValueError:
            continue
        if key == wanted and pid > 0:
            return f"pid {pid} on host {socket.gethostname()}"
    return "unknown"
