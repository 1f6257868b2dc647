"""kill -9 of a real writer process at many points of a write, then recovery.

Points (crash-state enumeration as in ALICE, "All File Systems Are Not Created Equal", OSDI 2014;
CRIU-style ``--fault N`` points):

* byte offsets of the pack's temporary file: 0, 1, 4095, 4096, the last byte, every byte, and
  random offsets (seeded, so a failure reproduces);
* just before and just after every ``rename``, ``fsync``, ``fchmod`` and ``unlink`` of the commit
  protocol (object rename, folder fsync, record write and rename, temporary cleanup), enumerated from
  a counting run.

After each kill: no eligible object is wrong (every ``<digest>.pack`` hashes to its name, and
admission agrees); the next run (a fresh writer process) repairs or rewrites it and succeeds; and
``gc`` then removes every temporary the dead writer left (its ``flock`` died with it).
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
from cache_support import WATCHED_CALLS, assert_no_wrong_eligible_object, child_command, run_child, sha256_of, temporaries

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cache.records import record_state

RANDOM_OFFSETS = 10


def _points(captured, tmp_path: Path) -> list[tuple[str, ...]]:
    rc, report, err = run_child(child_command(captured.checkpoint, captured.artifact_dir, tmp_path / "count", "--count-calls"))
    assert rc == 0, err
    calls = report["calls"]
    assert calls.get("rename", 0) >= 2 and calls.get("fsync", 0) >= 2, calls
    size = captured.pack.size_bytes
    rng = random.Random(20260611)
    offsets = sorted({0, 1, 4095, 4096, size - 1, size, *(rng.randrange(2, size - 1) for _ in range(RANDOM_OFFSETS))})
    points = [("--kill-at-byte", str(n)) for n in offsets]
    for name in WATCHED_CALLS:
        for k in range(1, calls.get(name, 0) + 1):
            for when in ("before", "after"):
                points.append(("--kill-at", f"{name}:{k}:{when}"))
    return points


@pytest.mark.slow  # about 19 s: dozens of writer processes killed at each point
def test_kill_9_at_many_points_never_leaves_a_wrong_eligible_object(captured, tmp_path: Path) -> None:
    """At >= 20 kill points: nothing wrong is ever eligible, the next run succeeds and leaves the one
    correct object with a trusted record, and gc clears the dead writer's temporaries. Catches a
    rename before fsync/size/digest checks, a non-unique temporary name, a record written before the
    object, or a cleanup that removes a valid object."""
    points = _points(captured, tmp_path)
    assert len(points) >= 20
    digest = captured.pack.sha256
    killed = 0
    for i, point in enumerate(points):
        state = tmp_path / f"state-{i}"
        rc, report, err = run_child(child_command(captured.checkpoint, captured.artifact_dir, state, *point))
        if rc == -signal.SIGKILL:
            killed += 1
        else:
            # A point past the end of the work (e.g. an unlink that never happens): it must have succeeded.
            assert rc == 0 and report["ok"], (point, rc, report, err)
        assert_no_wrong_eligible_object(state)

        rc, report, err = run_child(child_command(captured.checkpoint, captured.artifact_dir, state))
        assert rc == 0 and report["ok"], (point, report, err)
        cache = PayloadCache(state)
        assert sha256_of(cache.object_path(digest)) == digest, point
        assert record_state(cache, digest) == "trusted", point

        cache.gc(older_than_seconds=0)
        assert temporaries(state) == [], (point, temporaries(state))
        assert cache.digests() == [digest]
    assert killed >= 20


@pytest.mark.parametrize("point", [("--kill-at", "rename:1:before"), ("--kill-at-byte", "4096")])
def test_temporary_of_a_killed_writer_is_stale_but_never_eligible(captured, tmp_path: Path, point) -> None:
    """Right after a kill before the rename, the partial file exists only under ``tmp/`` (never at
    an object path), admission reports the pack missing, and gc removes it."""
    state = tmp_path / "state"
    rc, _, _ = run_child(child_command(captured.checkpoint, captured.artifact_dir, state, *point))
    assert rc == -signal.SIGKILL
    cache = PayloadCache(state)
    assert cache.digests() == []
    assert len(temporaries(state)) == 1 and temporaries(state)[0].name.endswith(".partial")
    report = cache.gc(older_than_seconds=0)
    assert len(report.temporaries) == 1 and temporaries(state) == []
