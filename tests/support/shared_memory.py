"""The ``/dev/shm`` entries that engine processes leave behind when they exit, and their removal.

vLLM's and SGLang's worker processes create POSIX named semaphores through ``multiprocessing``
(``sem.mp-*``), and SGLang 0.5.23 also its load bookkeeping and scheduler message queues
(``sglang_loads_*``, ``sgl_shm_mq_*``), and vLLM's CPU tensor parallel workers their shared-memory
communicator's buffers (``vllm_dist_*-cpushm_*``, ``vllm/distributed/device_communicators/cpu_communicator.py``); a killed or fast-exiting process never unlinks them, so each
engine start used to leave a few on the node. The suite removes, at its end, only the entries that
match these prefixes, belong to this user, appeared while it ran, and that no live process still has
open or mapped (so a concurrent run of the same user keeps the segments it is using).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

SHARED_MEMORY = Path("/dev/shm")
ENGINE_SHARED_MEMORY_PREFIXES = ("sem.mp-", "sglang_loads_", "sgl_shm_mq_", "vllm_dist_")


def engine_entries(folder: Path = SHARED_MEMORY) -> set[str]:
    """Names in ``folder`` with an engine prefix that belong to this user (another user's are never listed)."""
    try:
        names = [name for name in os.listdir(folder) if name.startswith(ENGINE_SHARED_MEMORY_PREFIXES)]
    except OSError:
        return set()
    owned = set()
    for name in names:
        with contextlib.suppress(OSError):
            if os.lstat(folder / name).st_uid == os.getuid():
                owned.add(name)
    return owned


def inodes_in_use(folder: Path = SHARED_MEMORY) -> set[int]:
    """Inode numbers of the files in ``folder`` that some process this user can inspect has open
    (``/proc/PID/fd``) or mapped (``/proc/PID/maps``).

    Inodes, not names: glibc's ``sem_open`` creates a named semaphore under a temporary name
    (``sem.XXXXXX``), maps it, links it to ``sem.<name>`` and unlinks the temporary name, so a live
    semaphore's mapping reads ``/dev/shm/sem.XXXXXX (deleted)`` and only its inode (the fifth field of a
    maps line, ``proc(5)``) ties it to the entry.
    """
    prefix = str(folder) + "/"
    used: set[int] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                if prefix in line:
                    fields = line.split(maxsplit=5)
                    with contextlib.suppress(IndexError, ValueError):
                        used.add(int(fields[4]))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                        used.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
    return used


def remove_left_entries(before: set[str], folder: Path = SHARED_MEMORY) -> list[str]:
    """Remove this user's engine entries of ``folder`` that are not in ``before`` and that no live process
    holds; returns the names removed. Never raises for an entry (gone already, or not removable)."""
    removed = []
    candidates = engine_entries(folder) - before
    if not candidates:
        return removed
    in_use = inodes_in_use(folder)
    for name in sorted(candidates):
        with contextlib.suppress(OSError):
            if os.lstat(folder / name).st_ino in in_use:
                continue
            os.unlink(folder / name)
            removed.append(name)
    return removed
