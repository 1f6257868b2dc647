"""A fresh node's restore from a payload store in a process of its own, for the kill and two-node tests of
``test_onepass_fetch.py``: worker 0 of ARTIFACT is restored into a fresh ``TinyModel`` (``tests/restore``) from the
store SPEC (a folder, or an ``s3://`` URL reached through the environment's ``AWS_*`` variables): the fetch of a node
whose cache lacks the pack, hashed as it lands.

usage: ``onepass_child.py CHECKPOINT ARTIFACT STATE_ROOT SPEC [--range-bytes N] [--start-file PATH] [faults]``

It prints one JSON line, ``{"ok": true, "same": <the restored bytes equal a load of CHECKPOINT>}`` or
``{"ok": false, "error": "<class>", "message": "..."}``. Faults (each a real ``SIGKILL`` of this process):

* ``--kill-at-landed N``: once ``N`` bytes of the pack have landed in the cache's temporary (the landing that
  reaches ``N`` is written whole first);
* ``--kill-at CALL:K:WHEN``: just before or after the ``K``-th ``os.CALL`` (``rename``, ``fsync``, ``fchmod``,
  ``unlink``), the commit protocol's steps (:mod:`cache_support`);
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def _store(spec: str, range_bytes: int | None):
    from coldsnap_core.stores import parse_store_spec
    from coldsnap_core.stores.s3 import S3PayloadStore

    if spec.startswith("s3://") and range_bytes:
        return S3PayloadStore.from_url(spec, part_size_bytes=range_bytes)
    return parse_store_spec(spec)


def _kill_at_landed(limit: int) -> None:
    from coldsnap_core.restore.staging import LandedHash

    real, landed = LandedHash.landed, [0]

    def land(self, offset_bytes: int, size_bytes: int) -> None:
        real(self, offset_bytes, size_bytes)
        landed[0] += size_bytes
        if landed[0] >= limit:
            os.kill(os.getpid(), signal.SIGKILL)

    LandedHash.landed = land


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("state_root", type=Path)
    parser.add_argument("spec")
    parser.add_argument("--range-bytes", type=int, default=None)
    parser.add_argument("--start-file", type=Path, default=None)
    parser.add_argument("--kill-at-landed", type=int, default=None)
    parser.add_argument("--kill-at", default=None)
    args = parser.parse_args(argv)

    from cache_support import _install_faults

    from coldsnap_core.copy.host import HostCopyBackend
    from coldsnap_core.copy.torch_allocations import enumerate_allocations
    from coldsnap_core.errors import ColdsnapError
    from tests.restore.test_worker_restore import TinyModel, restorer

    expected = TinyModel()
    expected.load(args.checkpoint)
    fresh = TinyModel()
    attempt = restorer(args.checkpoint, args.artifact, args.state_root, store=_store(args.spec, args.range_bytes))
    if args.start_file is not None:
        while not args.start_file.exists():
            time.sleep(0.005)
    faults = argparse.Namespace(break_flock=False, fsize_limit=None, kill_at=args.kill_at, kill_at_byte=None)
    _install_faults(faults, {})
    if args.kill_at_landed is not None:
        _kill_at_landed(args.kill_at_landed)
    try:
        attempt.run(enumerate_allocations(fresh), HostCopyBackend(threads=2))
    except ColdsnapError as exc:
        print(json.dumps({"ok": False, "error": type(exc).__name__, "message": str(exc)}), flush=True)
        return 1
    print(json.dumps({"ok": True, "same": fresh.snapshot() == expected.snapshot()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(REPO), str(HERE)]
    sys.exit(main())
