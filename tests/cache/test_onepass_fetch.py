"""A fresh node's restore from a payload store in one verified pass: as the pack's bytes land in the cache's temporary
each stored extent is checked against the manifest and copied into its allocations and each padding run checked zero
(``coldsnap_core.restore.staging.LandedFill``), the whole file is hashed in order (``LandedHash``) and committed with
the validation record of that hash, on every store kind and its real server (``any_store``), with the engine-free
tiny torch model of ``tests/restore``.

Each test says which regression it catches; the kill and two-node tests run real processes (``onepass_child.py``).
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cache_support import assert_no_wrong_eligible_object, eligible_objects, run_child, temporaries

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cache.records import record_state
from coldsnap_core.copy.host import HostCopyBackend, host_view
from coldsnap_core.copy.torch_allocations import enumerate_allocations
from coldsnap_core.errors import ExtentDigestMismatchError, NonZeroPaddingError, PackDigestMismatchError, PackSizeMismatchError
from coldsnap_core.format.manifest import NATIVE_MANIFEST_FILENAME, PackRef
from coldsnap_core.format.verify import check_manifest
from coldsnap_core.restore import staging
from coldsnap_core.restore.pipeline import restore_or_fall_back
from coldsnap_core.settings import ColdsnapSettings
from coldsnap_core.stores.local import LocalFolderStore
from tests.restore.test_worker_restore import RANK0, TinyModel, capture, restorer
from tests.support.observer_support import write_checkpoint

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@pytest.fixture
def tiny(tmp_path: Path):
    """The tiny model captured into ``tmp_path/artifact`` (pack in ``tmp_path/capture``): (checkpoint, model,
    capture result, pack bytes)."""
    folder = tmp_path / "model"
    folder.mkdir()
    checkpoint = write_checkpoint(folder)
    loaded = TinyModel()
    result = capture(loaded, checkpoint, tmp_path / "artifact", tmp_path / "capture")
    return checkpoint, loaded, result, result.pack_path.read_bytes()


def _nothing_kept(cache: PayloadCache) -> None:
    assert cache.digests() == [] and cache.temporaries() == []
    assert not any(cache.objects_dir.glob("*.record"))


def _restore(checkpoint: Path, tmp_path: Path, store, node: str = "node"):
    """A fresh node's restore attempt from ``store`` and the fresh model it fills."""
    return restorer(checkpoint, tmp_path / "artifact", tmp_path / node, store=store), TinyModel()


def _no_second_read(monkeypatch) -> None:
    """Make the whole-file verifier of a fetched object fail the test if it runs: a one-pass fetch finds a bad extent
    or padding byte as it lands."""

    def refused(*args, **kwargs):
        raise AssertionError("the fetched pack was verified by a second whole-file read")

    monkeypatch.setattr(staging, "verify_pack_file", refused)


@pytest.mark.parametrize("which", ["first", "largest", "last"])
def test_a_flipped_extent_byte_in_the_store_is_refused_naming_the_extent(any_store, tiny, tmp_path, which, monkeypatch) -> None:
    """One flipped byte of a stored extent in the store's object: the fetch refuses it with
    ExtentDigestMismatchError naming the store's object, the extent's pack offset and a destination allocation and
    offset; the node keeps nothing (no object, no temporary, no record) and the attempt says the pack is unavailable.
    Fails if a fetched pack is only checked whole (PackDigestMismatchError, no extent named), if the extent is found
    only by reading the fetched file again after it landed (the two-pass fetch), or if anything of a refused fetch
    stays in the cache."""
    checkpoint, _, result, data = tiny
    _no_second_read(monkeypatch)
    entries = check_manifest(result.manifest).entries
    entry = {"first": entries[0], "largest": max(entries, key=lambda e: e.size_bytes), "last": entries[-1]}[which]
    corrupt = bytearray(data)
    corrupt[entry.offset_bytes + entry.size_bytes // 2] ^= 0x01
    any_store.put_raw(result.manifest.pack.sha256, bytes(corrupt))
    attempt, fresh = _restore(checkpoint, tmp_path, any_store.new_store())
    with pytest.raises(ExtentDigestMismatchError) as info:
        attempt.run(enumerate_allocations(fresh), HostCopyBackend())
    assert info.value.file == any_store.store.location(result.manifest.pack.sha256)
    assert f"pack offset {entry.offset_bytes} ({entry.size_bytes} bytes)" in str(info.value)
    assert "as it landed" in str(info.value)
    owners = {(e.allocation_index, e.offset_bytes) for e in result.manifest.model_extents if e.sha256 == entry.sha256}
    assert (info.value.allocation, info.value.offset_bytes) in owners
    assert attempt.pack_unavailable
    _nothing_kept(attempt.cache)


def test_a_flipped_padding_byte_in_the_store_is_refused_naming_its_offset(any_store, tiny, tmp_path, monkeypatch) -> None:
    """A non-zero padding byte in the store's object is refused as it lands (NonZeroPaddingError naming its pack offset
    and the store's object); nothing is kept. Fails if a fetched pack that does not hash to its name is refused
    without the offset of its bad byte, or only by reading the fetched file again after it landed."""
    checkpoint, _, result, data = tiny
    _no_second_read(monkeypatch)
    start, size = next(iter(check_manifest(result.manifest).padding_ranges()))
    corrupt = bytearray(data)
    corrupt[start + size - 1] = 0x7F
    any_store.put_raw(result.manifest.pack.sha256, bytes(corrupt))
    attempt, fresh = _restore(checkpoint, tmp_path, any_store.new_store())
    with pytest.raises(NonZeroPaddingError) as info:
        attempt.run(enumerate_allocations(fresh), HostCopyBackend())
    assert info.value.offset_bytes == start + size - 1
    assert info.value.file == any_store.store.location(result.manifest.pack.sha256)
    assert "as it landed" in str(info.value)
    _nothing_kept(attempt.cache)


@pytest.mark.parametrize("change", ["truncated", "extended"])
def test_a_truncated_or_extended_store_object_is_refused(any_store, tiny, tmp_path, change: str) -> None:
    """A store object of the wrong size is refused before a byte of it lands (PackSizeMismatchError naming the store's
    object and saying which); nothing is kept and the model is not written. Fails if a short or long object is
    fetched, hashed or read into the allocations."""
    checkpoint, _, result, data = tiny
    any_store.put_raw(result.manifest.pack.sha256, data[:-4096] if change == "truncated" else data + bytes(4096))
    attempt, fresh = _restore(checkpoint, tmp_path, any_store.new_store())
    before = fresh.snapshot()
    with pytest.raises(PackSizeMismatchError, match=change) as info:
        attempt.run(enumerate_allocations(fresh), HostCopyBackend())
    assert info.value.file == any_store.store.location(result.manifest.pack.sha256)
    assert fresh.snapshot() == before
    _nothing_kept(attempt.cache)


@pytest.mark.parametrize("where", ["extent", "padding"])
def test_under_auto_a_refused_fetch_reports_no_allocation_restored(tiny, tmp_path, where, monkeypatch) -> None:
    """``restore_or_fall_back`` under ``auto`` with a store whose copy has a bad extent (or padding byte), found as it
    lands while the allocations are being filled: the attempt is not reported restored (no hydration report), the
    fallback is the extent's (padding's) error, and the node keeps nothing. Fails if a load from a corrupt store copy
    is reported restored once its other extents were copied, or its refusal names no extent or offset."""
    checkpoint, _, result, data = tiny
    _no_second_read(monkeypatch)
    layout = check_manifest(result.manifest)
    store = tmp_path / "store"
    path = store / result.manifest.pack.path
    path.parent.mkdir(parents=True)
    corrupt = bytearray(data)
    if where == "extent":
        corrupt[layout.entries[-1].offset_bytes] ^= 0x01
    else:
        corrupt[next(iter(layout.padding_ranges()))[0]] = 0x01
    path.write_bytes(bytes(corrupt))
    extra = {"artifact_dir": str(tmp_path / "artifact"), "state_root": str(tmp_path / "node"), "payload_dir": str(store)}
    settings = ColdsnapSettings.resolve({}, {**extra, "restore": "auto"})[0]
    source = restorer(checkpoint, tmp_path / "artifact", tmp_path / "node").loaded
    outcome = restore_or_fall_back(TinyModel(), settings, RANK0, source)
    assert not outcome.restored and outcome.report is None
    assert isinstance(outcome.fallback, ExtentDigestMismatchError if where == "extent" else NonZeroPaddingError)
    assert outcome.fallback.allocation is not None if where == "extent" else outcome.fallback.offset_bytes is not None
    _nothing_kept(PayloadCache(tmp_path / "node"))


def _small_ranges(ranged_store, range_bytes: int):
    """Another client of ``ranged_store`` whose fetch reads ``range_bytes`` per ranged GET, eight at once (the
    template's attributes: GCS's upload chunk size must stay a multiple of 256 KiB)."""
    store = ranged_store.new_store()
    store.range_size_bytes, store.concurrency = range_bytes, 8
    return store


@pytest.mark.parametrize("range_bytes", [1536, 4096])
def test_many_small_ranges_restore_every_byte_and_commit(ranged_store, tiny, tmp_path, range_bytes: int) -> None:
    """Ranges smaller than an extent's padding stride (1536 bytes: extents and padding runs span ranges; 4096: one
    range per stored extent), eight in flight at once, landing out of order: every allocation holds the captured
    bytes and the node holds the object, hashing to its name, with a trusted validation record. Fails if the hash
    behind the landed prefix skips, repeats or reorders a span (the commit is then refused), or waits forever for
    a prefix that has landed."""
    checkpoint, loaded, result, data = tiny
    digest = result.manifest.pack.sha256
    ranged_store.put_raw(digest, data)
    attempt, fresh = _restore(checkpoint, tmp_path, _small_ranges(ranged_store, range_bytes))
    attempt.run(enumerate_allocations(fresh), HostCopyBackend())
    assert fresh.snapshot() == loaded.snapshot()
    assert hashlib.sha256(attempt.cache.object_path(digest).read_bytes()).hexdigest() == digest
    assert record_state(attempt.cache, digest) == "trusted" and attempt.cache.temporaries() == []


def test_a_fetch_fills_from_the_temporary_and_never_reads_the_pack_again(ranged_store, tiny, tmp_path, monkeypatch) -> None:
    """A fetched pack is hashed and copied as it lands: the temporary is read exactly once in full for the hash and
    each stored extent once per destination for the copy (from the page cache its write just filled), the committed
    object is never read, the whole-file verifier never runs on a good copy, and the record is written from that
    hash. Fails if staging verifies the fetched file with a second full read, hashes a span twice, or if the
    allocations are filled from the committed pack after the fetch (the two-pass fetch: land and hash, then read
    again to copy)."""
    checkpoint, loaded, result, data = tiny
    digest = result.manifest.pack.sha256
    ranged_store.put_raw(digest, data)
    reads: dict[str, int] = {"temporary": 0, "object": 0}
    real_preadv = os.preadv

    def counted(fd: int, buffers, offset: int, *flags) -> int:
        n = real_preadv(fd, buffers, offset, *flags)
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name.endswith(".partial"):
            reads["temporary"] += n
        elif name.endswith(".pack"):
            reads["object"] += n
        return n

    monkeypatch.setattr(os, "preadv", counted)
    _no_second_read(monkeypatch)
    attempt, fresh = _restore(checkpoint, tmp_path, _small_ranges(ranged_store, 4096))
    attempt.run(enumerate_allocations(fresh), HostCopyBackend())
    assert fresh.snapshot() == loaded.snapshot()
    assert reads == {"temporary": len(data) + result.manifest.model_bytes, "object": 0}, reads
    assert record_state(attempt.cache, digest) == "trusted"


def test_allocations_hold_an_extent_before_the_fetch_ends(ranged_store, tiny, tmp_path) -> None:
    """A store whose fetch, once the first stored extent's range has landed, waits until that extent's bytes are in
    its allocation: they arrive there while the fetch still runs (no object committed yet), and the restore then
    completes with every byte. Fails if the allocations are filled only after the whole pack landed (the fetch then
    waits in vain and the check fails), or if an early copy leaves a wrong byte."""
    checkpoint, loaded, result, data = tiny
    digest = result.manifest.pack.sha256
    ranged_store.put_raw(digest, data)
    first = check_manifest(result.manifest).entries[0]
    extent = next(e for e in result.manifest.model_extents if e.pack_offset_bytes == first.offset_bytes)
    store = _small_ranges(ranged_store, 4096)
    attempt, fresh = _restore(checkpoint, tmp_path, store)
    allocations = enumerate_allocations(fresh)
    destination = allocations.live[extent.allocation_index]
    copied = threading.Event()

    class Watched(HostCopyBackend):
        def fill(self, ops, sources, allocations, *, verify_extents):
            super().fill(ops, sources, allocations, verify_extents=verify_extents)
            if any(op.source == "pack" and op.source_offset_bytes == first.offset_bytes for op in ops):
                copied.set()

    landed_bytes = bytearray(len(data))
    seen: list[tuple[bool, bytes, bool]] = []
    lock = threading.Lock()
    real_fetch = store.fetch

    def fetch(obj, size_bytes, fd, *, file, progress=None, landed=None):
        def hooked(offset_bytes: int, size: int) -> None:
            landed(offset_bytes, size)
            with lock:
                landed_bytes[offset_bytes : offset_bytes + size] = b"\1" * size
                due = not seen and all(landed_bytes[first.offset_bytes : first.end_bytes])
                if due:
                    seen.append((False, b"", False))
            if due:  # this range's thread holds the fetch open until the extent is in its allocation
                arrived = copied.wait(timeout=60)
                view = bytes(host_view(destination.address + extent.offset_bytes, extent.size_bytes))
                seen[0] = (arrived, view, attempt.cache.object_path(digest).exists())

        return real_fetch(obj, size_bytes, fd, file=file, progress=progress, landed=hooked)

    store.fetch = fetch
    attempt.run(allocations, Watched())
    assert seen == [(True, data[first.offset_bytes : first.end_bytes], False)]
    assert fresh.snapshot() == loaded.snapshot()
    assert record_state(attempt.cache, digest) == "trusted"


def _rename_pack(artifact: Path, digest: str, other: str) -> None:
    """Make the artifact's manifest (and ``artifact.json``) name the pack ``other`` instead of ``digest``, its extents
    unchanged, and re-pin the manifest in ``artifact.json`` (same size, the new SHA-256)."""
    manifest = artifact / "workers" / "worker-0-of-1" / NATIVE_MANIFEST_FILENAME
    before = manifest.read_bytes()
    after = before.replace(digest.encode(), other.encode())
    os.chmod(manifest, 0o644)
    manifest.write_bytes(after)
    descriptor = artifact / "artifact.json"
    text = descriptor.read_text().replace(digest, other)
    os.chmod(descriptor, 0o644)
    descriptor.write_text(text.replace(hashlib.sha256(before).hexdigest(), hashlib.sha256(after).hexdigest()))


def test_a_manifest_whose_pack_digest_disagrees_with_its_extents_keeps_nothing(tiny, tmp_path, monkeypatch) -> None:
    """The artifact's manifest names the pack by a digest its extents do not hash to (the store holds the canonical
    pack of those extents under that name): every extent verifies and is copied as it lands, but the whole-file
    SHA-256 run before the validation record differs, so the restore is refused (PackDigestMismatchError naming the
    store's object and the SHA-256 the bytes have); no object, no record, no temporary, and under ``auto`` nothing is
    reported restored. Fails if a fetch whose extents all verified is committed or given a record without its
    whole-file SHA-256 equal to its name."""
    checkpoint, _, result, data = tiny
    digest = result.manifest.pack.sha256
    other = hashlib.sha256(b"another pack").hexdigest()
    _rename_pack(tmp_path / "artifact", digest, other)
    store = tmp_path / "store"
    (store / PackRef.for_digest(other, len(data)).path).parent.mkdir(parents=True)
    (store / PackRef.for_digest(other, len(data)).path).write_bytes(data)
    _no_second_read(monkeypatch)
    attempt, fresh = _restore(checkpoint, tmp_path, LocalFolderStore(store))
    with pytest.raises(PackDigestMismatchError) as info:
        attempt.run(enumerate_allocations(fresh), HostCopyBackend())
    assert info.value.file == LocalFolderStore(store).location(other)
    assert digest in str(info.value) and "disagrees with its own extents" in str(info.value)
    _nothing_kept(attempt.cache)
    extra = {"artifact_dir": str(tmp_path / "artifact"), "state_root": str(tmp_path / "auto"), "payload_dir": str(store)}
    settings = ColdsnapSettings.resolve({}, {**extra, "restore": "auto"})[0]
    outcome = restore_or_fall_back(TinyModel(), settings, RANK0, attempt.loaded)
    assert not outcome.restored and isinstance(outcome.fallback, PackDigestMismatchError)
    _nothing_kept(PayloadCache(tmp_path / "auto"))


def test_a_fetched_pack_is_committed_only_on_its_whole_file_sha256(tiny, tmp_path) -> None:
    """The store holds, under another pack's name and at that pack's size, the bytes of a well-formed pack whose
    SHA-256 is not the name: staging refuses it with PackDigestMismatchError naming the store's object and the
    SHA-256 the bytes have; no object, no record, no temporary. Fails if a fetched object is committed, or given a
    record, without its whole-file SHA-256 equal to its name."""
    _, _, result, data = tiny
    digest = result.manifest.pack.sha256
    store = tmp_path / "store"
    cache = PayloadCache(tmp_path / "node")
    wrong = PackRef.for_digest(hashlib.sha256(b"other bytes").hexdigest(), len(data))
    (store / wrong.path).parent.mkdir(parents=True)
    (store / wrong.path).write_bytes(data)
    with pytest.raises(PackDigestMismatchError) as info:
        staging.stage_payload(wrong, cache=cache, store=LocalFolderStore(store))
    assert info.value.file == LocalFolderStore(store).location(wrong.sha256)
    assert digest in str(info.value)
    _nothing_kept(cache)


# --- real processes -------------------------------------------------------------------------------


def _child(checkpoint: Path, artifact: Path, state: Path, spec: str, *extra: str) -> list[str]:
    return [sys.executable, str(HERE / "onepass_child.py"), str(checkpoint), str(artifact), str(state), spec, *extra]


def _kill_points(size_bytes: int) -> list[tuple[str, ...]]:
    rng = random.Random(20261204)
    landed = sorted({1, size_bytes - 1, size_bytes, *(rng.randrange(2, size_bytes - 1) for _ in range(2))})
    points = [("--kill-at-landed", str(n)) for n in landed]
    return [*points, *(("--kill-at", f"{call}:1:{when}") for call in ("fsync", "rename") for when in ("before", "after"))]


@pytest.mark.slow  # about five minutes here: eighteen restoring processes killed, each followed by one that recovers
@pytest.mark.parametrize("kind", ["folder", "s3"])
def test_a_fetch_killed_at_random_points_leaves_nothing_wrong_eligible(kind, request, tiny, tmp_path, monkeypatch) -> None:
    """A restoring process SIGKILLed while its pack's bytes land (S3 ranges of 4 KiB, several in flight; the last
    byte landed but not yet hashed), at the commit's fsync and rename: no object at an object path is wrong and no
    record vouches for one; the next process restores every byte and leaves the object with a trusted record; gc
    then finds nothing of the dead writer. Fails if a partly fetched or unhashed object is ever eligible."""
    from store_servers import store_under_test

    checkpoint, _, result, data = tiny
    store = store_under_test(kind, request, tmp_path, monkeypatch)
    store.put_raw(result.manifest.pack.sha256, data)
    extra = ("--range-bytes", "4096") if kind == "s3" else ()
    killed = 0
    for i, point in enumerate(_kill_points(len(data))):
        state = tmp_path / f"node-{i}"
        rc, report, err = run_child(_child(checkpoint, tmp_path / "artifact", state, store.spec, *extra, *point), env=store.env)
        killed += rc == -signal.SIGKILL
        assert rc == -signal.SIGKILL or (report and report["ok"] and report["same"]), (point, rc, report, err)
        assert_no_wrong_eligible_object(state)
        rc, report, err = run_child(_child(checkpoint, tmp_path / "artifact", state, store.spec, *extra), env=store.env)
        assert rc == 0 and report["ok"] and report["same"], (point, rc, report, err)
        cache = PayloadCache(state)
        assert list(eligible_objects(state)) == [result.manifest.pack.sha256], point
        assert record_state(cache, result.manifest.pack.sha256) == "trusted", point
        cache.gc(older_than_seconds=0)
        assert temporaries(state) == [], (point, temporaries(state))
    assert killed >= len(_kill_points(len(data))) - 1


@pytest.mark.parametrize("kind", ["folder", "s3"])
def test_two_nodes_fetching_at_once_both_restore(kind, request, tiny, tmp_path, monkeypatch) -> None:
    """Two processes with two state roots (two nodes) restore from the same store at the same moment: both restore
    every byte and each leaves its own object with a trusted record. Fails if concurrent fetches of one object
    interfere (a shared temporary name, a lock across state roots, a server that serves one of them short)."""
    from store_servers import store_under_test

    checkpoint, _, result, data = tiny
    store = store_under_test(kind, request, tmp_path, monkeypatch)
    store.put_raw(result.manifest.pack.sha256, data)
    start = tmp_path / "start"
    extra = ("--range-bytes", "4096") if kind == "s3" else ()
    children = [
        subprocess.Popen(
            _child(checkpoint, tmp_path / "artifact", tmp_path / f"node-{n}", store.spec, *extra, "--start-file", str(start)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, **store.env},
        )
        for n in "ab"
    ]
    start.touch()
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0 and '"same": true' in out, (out, err)
    for n in "ab":
        cache = PayloadCache(tmp_path / f"node-{n}")
        assert list(eligible_objects(tmp_path / f"node-{n}")) == [result.manifest.pack.sha256]
        assert record_state(cache, result.manifest.pack.sha256) == "trusted"
