"""A live process that holds a digest's lock and never lets go (a hung holder), for the lock timeout tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def hold_lock(state_root: Path, digest: str) -> subprocess.Popen:
    """Start a process that takes ``digest``'s lock in ``state_root``'s cache the way coldsnap does
    (:meth:`coldsnap_core.cache.payload_cache.PayloadCache.lock`) and sleeps 120 s holding it; returns once it holds
    it. The caller kills and waits for it."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from coldsnap_core.cache.payload_cache import PayloadCache\n"
            "with PayloadCache(sys.argv[1]).lock(sys.argv[2]):\n"
            "    print('held', flush=True)\n"
            "    time.sleep(120)\n",
            str(state_root),
            digest,
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder
