"""Live processes that hold a digest's lock and never let go (a hung holder), for the lock timeout tests, or hold a
pack as a running load does, for the cache life cycle tests."""

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


def hold_pack_in_a_process(state_root: Path, digest: str) -> subprocess.Popen:
    """Start a process that holds ``digest`` as a running load does, with the hold the restore takes from the pack's
    admission to the end of its copy (:func:`coldsnap_core.cache.pack_use.hold_pack`), and sleeps 120 s holding it;
    returns once it holds it. The caller kills and waits for it."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from coldsnap_core.cache.pack_use import hold_pack\n"
            "from coldsnap_core.cache.payload_cache import PayloadCache\n"
            "with hold_pack(PayloadCache(sys.argv[1]), sys.argv[2]) as held:\n"
            "    print('held' if held else 'not held', flush=True)\n"
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
