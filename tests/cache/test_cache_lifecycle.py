"""The packs' life cycle (``coldsnap_core.cache.pack_use``, ``coldsnap cache ls|rm|gc``): last use, the hold of a
running load, removal and least-recently-used eviction, on real packs committed by the cache, real processes and
real ``flock`` (``docs/format.md`` §10)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coldsnap_core.cache.pack_use import evict, hold_pack, list_packs, pack_in_use, remove_pack
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cli.main import main
from coldsnap_core.errors import InvalidDigestError, MissingObjectError, PackInUseError
from tests.support.locks import hold_pack_in_a_process

REPO = Path(__file__).resolve().parents[2]
DAY_NS = 86400 * 10**9


def commit_pack(cache: PayloadCache, size_bytes: int, seed: int) -> str:
    """Commit ``size_bytes`` bytes derived from ``seed`` as a pack, as capture and staging do; returns its digest."""
    data = hashlib.sha256(str(seed).encode()).digest() * (size_bytes // 32) + bytes(size_bytes % 32)
    digest = hashlib.sha256(data).hexdigest()
    with cache.temporary("capture") as (fd, path):
        os.write(fd, data)
        cache.commit(fd, path, sha256=digest, size_bytes=len(data))
    return digest


def used_days_ago(cache: PayloadCache, digest: str, days: float) -> None:
    """Set the pack's last use ``days`` before its current one (its use file's mtime)."""
    ns = os.stat(cache.use_path(digest)).st_mtime_ns - int(days * DAY_NS)
    os.utime(cache.use_path(digest), ns=(ns, ns))


def cli(*args: str) -> tuple[int, dict]:
    """``coldsnap ARGS --json`` in a real process: exit code and its document."""
    done = subprocess.run(
        [sys.executable, "-m", "coldsnap_core.cli.main", *args, "--json"], capture_output=True, text=True, cwd=REPO, check=False
    )
    return done.returncode, json.loads(done.stdout)


def test_commit_and_a_load_set_the_last_use_and_gc_evicts_least_recently_used_first(tmp_path: Path) -> None:
    """Packs committed a, b, c; then a load holds a: the eviction order is b, c, a, and --max-bytes for two packs
    removes b alone (catches an eviction by name, by size, by commit time, or a hold that does not record its use)."""
    cache = PayloadCache(tmp_path / "state")
    a, b, c = (commit_pack(cache, 4096, seed) for seed in (3, 1, 2))
    with hold_pack(cache, a) as held:
        assert held
    order = [p.digest for p in sorted(list_packs(cache), key=lambda p: p.last_used_ns)]
    assert order == [b, c, a]
    code, doc = cli("cache", "ls", "--sort", "used", "--state-root", str(cache.state_root))
    assert code == 0 and [o["digest"] for o in doc["objects"]] == [b, c, a]
    code, doc = cli("cache", "gc", "--max-bytes", str(2 * 4096), "--state-root", str(cache.state_root))
    assert code == 0, doc
    assert [p["digest"] for p in doc["removed"]["packs"]] == [b] and doc["pack_bytes"] == 2 * 4096
    assert sorted(cache.digests()) == sorted([a, c])


def test_unused_for_removes_only_packs_last_used_longer_ago(tmp_path: Path) -> None:
    """--unused-for 7d removes the pack last used 8 days ago and keeps the ones used 6 days ago and now (catches a
    comparison the wrong way round or in the wrong unit)."""
    cache = PayloadCache(tmp_path / "state")
    old, recent, fresh = (commit_pack(cache, 1000, seed) for seed in range(3))
    used_days_ago(cache, old, 8)
    used_days_ago(cache, recent, 6)
    code, doc = cli("cache", "gc", "--unused-for", "7d", "--dry-run", "--state-root", str(cache.state_root))
    assert code == 0 and [p["digest"] for p in doc["removed"]["packs"]] == [old]
    assert len(cache.digests()) == 3  # a dry run removes nothing
    code, doc = cli("cache", "gc", "--unused-for", "7d", "--state-root", str(cache.state_root))
    assert code == 0 and [p["digest"] for p in doc["removed"]["packs"]] == [old]
    assert sorted(cache.digests()) == sorted([recent, fresh])
    assert not cache.record_path(old).exists() and not cache.use_path(old).exists()


def test_max_bytes_ends_at_or_under_the_limit(tmp_path: Path) -> None:
    """Packs of 3000, 5000, 7000 and 11000 bytes with a limit of 12000: gc removes least recently used packs until
    the rest fit, and no more (catches an off-by-one that stops above the limit, or one that removes everything)."""
    cache = PayloadCache(tmp_path / "state")
    digests = [commit_pack(cache, size, seed) for seed, size in enumerate((3000, 5000, 7000, 11000))]
    for days, digest in zip((1, 4, 3, 2), digests, strict=True):
        used_days_ago(cache, digest, days)
    code, doc = cli("cache", "gc", "--max-bytes", "12000", "--state-root", str(cache.state_root))
    left = sum(p.size_bytes for p in list_packs(cache))
    assert code == 0 and left == doc["pack_bytes"] <= 12000
    # least recently used first: 5000 (4 days), then 7000 (3 days) brings 26000 to 14000, then 11000 (2 days) to 3000
    assert [p["digest"] for p in doc["removed"]["packs"]] == [digests[1], digests[2], digests[3]]
    assert cache.digests() == [digests[0]]


def test_a_pack_a_running_load_holds_is_never_removed(tmp_path: Path) -> None:
    """A real process holds pack a as a restore does: cache rm refuses it with rule pack-in-use naming its use file,
    gc --max-bytes 0 and --unused-for 0 remove every other pack and keep it (exit 4: still over the limit), and
    once the holder is gone gc removes it (catches a remover that ignores the hold, or a hold gc never sees released)."""
    cache = PayloadCache(tmp_path / "state")
    a, b = commit_pack(cache, 2048, 1), commit_pack(cache, 2048, 2)
    holder = hold_pack_in_a_process(cache.state_root, a)
    try:
        assert pack_in_use(cache, a) and not pack_in_use(cache, b)
        with pytest.raises(PackInUseError, match="a running load holds the pack") as info:
            remove_pack(cache, a)
        assert info.value.file == str(cache.use_path(a)) and info.value.rule == "pack-in-use"
        code, doc = cli("cache", "rm", a, "--state-root", str(cache.state_root))
        assert code == 4 and doc["error"]["rule"] == "pack-in-use"
        code, doc = cli("cache", "gc", "--unused-for", "0", "--max-bytes", "0", "--state-root", str(cache.state_root))
        assert code == 4 and [p["digest"] for p in doc["removed"]["packs"]] == [b] and doc["kept_in_use"] == [a]
        code, doc = cli("cache", "ls", "--state-root", str(cache.state_root))
        assert [(o["digest"], o["in_use"]) for o in doc["objects"]] == [(a, True)]
        assert cache.digests() == [a] and cache.record_path(a).exists()
    finally:
        holder.kill()
        holder.wait()
    assert evict(cache, max_bytes=0).removed[0].digest == a
    assert cache.digests() == []


def test_rm_force_removes_a_held_pack(tmp_path: Path) -> None:
    """--force removes a pack a load holds and says so (was_in_use), leaving neither record nor object."""
    cache = PayloadCache(tmp_path / "state")
    a = commit_pack(cache, 2048, 1)
    holder = hold_pack_in_a_process(cache.state_root, a)
    try:
        code, doc = cli("cache", "rm", a, "--force", "--state-root", str(cache.state_root))
    finally:
        holder.kill()
        holder.wait()
    assert code == 0 and doc["removed"]["digest"] == a and doc["removed"]["was_in_use"] is True
    assert not cache.object_path(a).exists() and not cache.record_path(a).exists()


GC_AT_THE_SIGNAL = (
    "import os, sys, time\n"
    "from coldsnap_core.cli.main import main\n"
    "print('ready', flush=True)\n"
    "while not os.path.exists(sys.argv[1]):\n"
    "    time.sleep(0.001)\n"
    "sys.exit(main(sys.argv[2:]))\n"
)
"""``coldsnap ARGS`` once the file ``argv[1]`` exists (imported before, so that two processes start together)."""


def test_two_gc_at_once_remove_each_pack_once(tmp_path: Path) -> None:
    """Two real gc processes started together on 100 packs with --max-bytes 0: every pack is removed by exactly one
    of them, and neither reports an error or a pack kept in use (catches a removal counted by a process that found
    the pack gone, or one process taking the other's removal for a running load)."""
    cache = PayloadCache(tmp_path / "state")
    digests = sorted(commit_pack(cache, 4096, seed) for seed in range(100))
    signal = tmp_path / "go"
    command = [sys.executable, "-c", GC_AT_THE_SIGNAL, str(signal), "cache", "gc", "--max-bytes", "0", "--json"]
    command += ["--state-root", str(cache.state_root)]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=REPO) for _ in range(2)]
    assert [run.stdout.readline().strip() for run in runs] == ["ready", "ready"]
    signal.touch()
    docs = [json.loads(run.communicate()[0]) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], docs
    removed = [[p["digest"] for p in doc["removed"]["packs"]] for doc in docs]
    assert sorted(removed[0] + removed[1]) == digests  # each pack once: no digest twice, none missing
    assert [doc["kept_in_use"] for doc in docs] == [[], []]
    assert cache.digests() == [] and sum(doc["bytes_freed"] for doc in docs) == 100 * 4096


def test_a_use_file_probed_by_another_gc_for_an_instant_is_not_a_running_load(tmp_path: Path) -> None:
    """Another process's in-use probe (an exclusive ``flock`` on the use file for an instant, as every gc takes while
    it lists the packs) does not make a removal report the pack as held by a running load (catches the second of two
    gc processes started together keeping a pack "in use" that no load held)."""
    import fcntl
    import threading

    cache = PayloadCache(tmp_path / "state")
    digest = commit_pack(cache, 4096, 1)
    with hold_pack(cache, digest):
        pass  # the use file exists, as after any load
    probe = os.open(cache.use_path(digest), os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_EX)
    releaser = threading.Timer(0.05, os.close, (probe,))
    releaser.start()
    try:
        assert remove_pack(cache, digest).digest == digest
    finally:
        releaser.join()
    assert cache.digests() == []


def test_rm_of_an_unknown_or_invalid_digest_is_a_typed_error(tmp_path: Path, capsys) -> None:
    """An unknown digest is rule object-present naming the object path (exit 3); a malformed one is digest-form
    (exit 4) before any file is touched."""
    cache = PayloadCache(tmp_path / "state")
    commit_pack(cache, 100, 1)
    unknown = "ab" * 32
    with pytest.raises(MissingObjectError, match="not in the node-local cache") as info:
        remove_pack(cache, unknown)
    assert info.value.file == str(cache.object_path(unknown))
    assert main(["cache", "rm", unknown, "--state-root", str(cache.state_root), "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["error"]["rule"] == "object-present"
    with pytest.raises(InvalidDigestError):
        remove_pack(cache, "../x")
    assert main(["cache", "rm", "../x", "--state-root", str(cache.state_root)]) == 4
    assert len(cache.digests()) == 1


def test_ls_names_the_artifacts_that_use_each_pack(captured, tmp_path: Path) -> None:
    """A captured artifact found in the load outcome log is listed with its pack and no other; a folder from the log
    that is gone names nothing; --artifact names one the log does not (catches a listing by log line alone, or one
    that gives every pack every artifact)."""
    cache = PayloadCache(captured.capture_root)
    other = commit_pack(cache, 100, 1)
    log = tmp_path / "outcomes.jsonl"
    line = {"format": "coldsnap.load-outcome", "format_version": 1, "outcome": "restored"}
    lines = [{**line, "artifact_dir": str(captured.artifact_dir)}, {**line, "artifact_dir": str(tmp_path / "gone")}]
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    code, doc = cli("cache", "ls", "--state-root", str(cache.state_root), "--outcome-log", str(log))
    assert code == 0
    assert {o["digest"]: o["artifacts"] for o in doc["objects"]} == {
        captured.pack.sha256: [str(captured.artifact_dir)],
        other: [],
    }
    code, doc = cli("cache", "ls", "--state-root", str(cache.state_root), "--artifact", str(captured.artifact_dir))
    assert {o["digest"]: o["artifacts"] for o in doc["objects"]}[captured.pack.sha256] == [str(captured.artifact_dir)]


def test_rm_takes_a_unique_short_digest_as_the_logs_print_it_and_names_the_packs_of_an_ambiguous_one(
    tmp_path: Path, capsys
) -> None:
    """``cache rm`` with the first 12 (or more) hex characters of a digest, as the logs and ``cache ls`` print it,
    removes the one pack whose digest starts so; a prefix that starts two cached digests is refused naming both (exit
    4, nothing removed), one that starts none is not in the cache (exit 3), and fewer than 12 characters are no
    digest (exit 4). Fails if a short digest is refused (an operator then has to find the full one), or an ambiguous
    one removes a pack."""
    cache = PayloadCache(tmp_path / "state")
    a = commit_pack(cache, 100, 1)
    twin = a[:12] + ("1" if a[12] == "0" else "0") + a[13:]  # another cached name that starts with the same 12
    (cache.objects_dir / f"{twin}.pack").write_bytes(b"")
    state = ["--state-root", str(cache.state_root)]
    assert main(["cache", "rm", a[:12], *state]) == 4
    err = capsys.readouterr().err
    assert f"rule digest-form failed: {a[:12]} starts 2 cached packs' digests: {min(a, twin)}, {max(a, twin)}" in err
    assert err.count("; remedy: ") == 1 and sorted(cache.digests()) == sorted([a, twin])
    assert main(["cache", "rm", a[:11], *state]) == 4
    assert main(["cache", "rm", ("0" if a[0] != "0" else "1") * 12, *state]) == 3
    capsys.readouterr()
    assert main(["cache", "rm", a[:13], *state, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"]["digest"] == a
    assert cache.digests() == [twin]
