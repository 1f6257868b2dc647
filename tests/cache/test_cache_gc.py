"""``PayloadCache.gc``: stale temporaries of dead writers, quarantined objects, orphan records; never live work."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from cache_support import REPO, child_command, flip_byte, run_child, temporaries

from coldsnap_core.cache.payload_cache import PayloadCache


def test_gc_removes_a_dead_writers_temporary_but_not_a_young_one(captured, tmp_path: Path) -> None:
    """A writer killed mid-write leaves a ``.partial``: gc keeps it while it is younger than the
    threshold and removes it once older (its flock died with the writer)."""
    state = tmp_path / "state"
    rc, _, _ = run_child(child_command(captured.checkpoint, captured.artifact_dir, state, "--kill-at-byte", "10000"))
    assert rc == -9
    cache = PayloadCache(state)
    (partial,) = temporaries(state)
    report = cache.gc(older_than_seconds=3600)
    assert report.temporaries == () and report.kept_live == (partial,)
    old = time.time() - 7200
    os.utime(partial, (old, old))
    report = cache.gc(older_than_seconds=3600)
    assert report.temporaries == (partial,) and report.bytes_freed == 10000
    assert temporaries(state) == []


def test_gc_keeps_a_live_writers_temporary(tmp_path: Path) -> None:
    """A temporary whose writer (another real process) is alive and holds its flock is kept, however
    old (catches a gc that decides by age alone and deletes work in progress)."""
    state = tmp_path / "state"
    script = (
        "import sys, time\n"
        "from coldsnap_core.cache.payload_cache import PayloadCache\n"
        "with PayloadCache(sys.argv[1]).temporary('capture') as (fd, path):\n"
        "    print(path, flush=True)\n"
        "    time.sleep(60)\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", script, str(state)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        path = Path(writer.stdout.readline().strip())
        old = time.time() - 7200
        os.utime(path, (old, old))
        report = PayloadCache(state).gc(older_than_seconds=0)
        assert report.temporaries == () and path in report.kept_live
        assert path.exists()
    finally:
        writer.kill()
        writer.wait()
    report = PayloadCache(state).gc(older_than_seconds=0)
    assert report.temporaries == (path,) and not path.exists()


def test_gc_removes_quarantine_orphan_records_and_download_folders(captured) -> None:
    """Quarantined objects older than the threshold, records without objects and leftover
    ``.partial.d`` download folders go; objects, their records and lock files stay."""
    cache = PayloadCache(captured.capture_root)
    digest = captured.pack.sha256
    flip_byte(captured.pack_path, 1)
    cache.quarantine(digest)
    (cache.objects_dir / f"{'a' * 64}.pack.record").write_text("{}")
    scratch = cache.tmp_dir / f"{'b' * 64}.0123456789abcdef.partial.d"
    (scratch / "model-payloads").mkdir(parents=True)
    (scratch / "model-payloads" / "blob").write_bytes(b"z" * 100)
    old = time.time() - 7200
    os.utime(scratch, (old, old))
    lock = cache.lock_path(digest)
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()

    dry = cache.gc(older_than_seconds=3600, dry_run=True)
    assert dry.quarantined == ()  # just quarantined: kept for inspection until it is old
    assert dry.orphan_records == (cache.objects_dir / f"{'a' * 64}.pack.record",) and dry.temporaries == (scratch,)
    assert scratch.exists() and len(cache.quarantined()) == 1  # a dry run removes nothing
    report = cache.gc(older_than_seconds=0)
    assert len(report.quarantined) == 1 and report.orphan_records == dry.orphan_records
    assert report.temporaries == (scratch,)
    assert cache.quarantined() == [] and cache.temporaries() == [] and not scratch.exists()
    assert not (cache.objects_dir / f"{'a' * 64}.pack.record").exists()
    assert lock.exists()


def test_gc_on_a_missing_cache_is_a_no_op(tmp_path: Path) -> None:
    cache = PayloadCache(tmp_path / "nothing")
    report = cache.gc(older_than_seconds=0)
    assert report.temporaries == report.quarantined == report.orphan_records == ()
    assert not (tmp_path / "nothing").exists()
