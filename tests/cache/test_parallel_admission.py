"""First use of a pack that arrived without a validation record (rsync, a bind mount, a restored volume).

A restore admits it by its manifest's layout: every stored extent's SHA-256 and every padding byte, on a pool
of threads; the whole-file SHA-256 and the record follow on a daemon thread after the copy. Each test runs the
engine-free tiny torch model of ``tests/restore`` (or the cache alone) on real files and names the regression it
catches.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import pytest

from coldsnap_core.cache import payload_cache
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cache.records import record_state
from coldsnap_core.cli.main import main
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.copy.torch_allocations import enumerate_allocations
from coldsnap_core.errors import ExtentDigestMismatchError, NonZeroPaddingError, PackSizeMismatchError
from coldsnap_core.format import verify
from coldsnap_core.format.verify import admission_threads, check_manifest
from tests.restore.test_worker_restore import TinyModel, capture, restorer
from tests.support.files import flip_byte
from tests.support.observer_support import write_checkpoint

WAIT_SECONDS = 30.0


@pytest.fixture
def tiny(tmp_path: Path):
    """The tiny model captured into ``tmp_path/artifact``; its pack copied, without a record, into the cache of
    ``tmp_path/node`` as a copying tool would leave it. Returns (checkpoint, loaded model, capture result, the
    node's cache)."""
    folder = tmp_path / "model"
    folder.mkdir()
    checkpoint = write_checkpoint(folder)
    loaded = TinyModel()
    result = capture(loaded, checkpoint, tmp_path / "artifact", tmp_path / "capture")
    cache = PayloadCache(tmp_path / "node")
    cache.ensure_dirs()
    shutil.copyfile(result.pack_path, cache.object_path(result.manifest.pack.sha256))
    return checkpoint, loaded, result, cache


def _block_the_whole_file_hash(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make the background whole-file SHA-256 wait until the second returned event is set; the first is set
    once the hash has started (its file is open)."""
    started, release = threading.Event(), threading.Event()
    original = payload_cache.sha256_file

    def blocked(*args, **kwargs):
        started.set()
        assert release.wait(WAIT_SECONDS)
        return original(*args, **kwargs)

    monkeypatch.setattr(payload_cache, "sha256_file", blocked)
    return started, release


def test_a_copied_pack_is_admitted_by_its_extents_on_several_threads_and_recorded_after_the_load(
    tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore admits a record-less pack with its extents hashed on two threads at once (each first extent
    waits at a two-party barrier, which a one-thread check breaks), returns the restored model while the
    whole-file hash is still held back (a record written before the load returns, or a load that waits for it,
    fails here), and the record appears once that hash finishes; a later start then reads nothing."""
    checkpoint, loaded, result, cache = tiny
    digest = result.manifest.pack.sha256
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    barrier, hashed_on = threading.Barrier(2, timeout=WAIT_SECONDS), set()
    original = verify._stored_extent_matches

    def spied(*args):
        name = threading.current_thread().name
        if name not in hashed_on:
            hashed_on.add(name)
            barrier.wait()
        return original(*args)

    monkeypatch.setattr(verify, "_stored_extent_matches", spied)
    _, release = _block_the_whole_file_hash(monkeypatch)

    fresh = TinyModel()
    attempt = restorer(checkpoint, tmp_path / "artifact", tmp_path / "node")
    attempt.run(enumerate_allocations(fresh), HostCopyBackend())
    assert fresh.snapshot() == loaded.snapshot()
    assert len(hashed_on) == 2
    assert not attempt.cache.record_path(digest).exists()

    release.set()
    assert attempt.cache.wait_for_records(WAIT_SECONDS)
    assert record_state(cache, digest) == "trusted"
    read = []
    PayloadCache(tmp_path / "node").admit(digest, result.manifest.pack.size_bytes, progress=read.append)
    assert read == []


def test_admission_threads_are_the_usable_cores_up_to_eight(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool is as large as the CPUs this process may run on, at most 8 (catches a pool of ``os.cpu_count()``,
    which ignores a container's CPU set, or an unbounded one)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(3)))
    assert admission_threads() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert admission_threads() == 8


def _first_padding_offset(result) -> int:
    return next(start for start, _ in check_manifest(result.manifest).padding_ranges())


@pytest.mark.parametrize("damage", ["extent", "padding", "truncated", "extended"])
def test_a_damaged_copy_is_refused_by_name_quarantined_and_never_recorded(tiny, tmp_path: Path, damage: str) -> None:
    """A flipped extent byte names the extent's allocation and offset, a flipped padding byte its pack offset, a
    truncated or extended file its size; each copy is quarantined and no record is written, then or by the
    background hash (catches a parallel check that skips the padding, the size or an extent, or that admits
    before judging)."""
    checkpoint, _, result, cache = tiny
    digest = result.manifest.pack.sha256
    path = cache.object_path(digest)
    extent = max(result.manifest.model_extents, key=lambda e: e.size_bytes)
    if damage == "extent":
        flip_byte(path, extent.pack_offset_bytes + 3)
    elif damage == "padding":
        flip_byte(path, _first_padding_offset(result) + 1)
    else:
        with open(path, "r+b") as f:
            if damage == "truncated":
                f.truncate(result.manifest.pack.size_bytes - 4096)
            else:
                f.seek(0, os.SEEK_END)
                f.write(b"\0")
    expected = {"extent": ExtentDigestMismatchError, "padding": NonZeroPaddingError}.get(damage, PackSizeMismatchError)
    attempt = restorer(checkpoint, tmp_path / "artifact", tmp_path / "node")
    with pytest.raises(expected) as raised:
        attempt.run(enumerate_allocations(TinyModel()), HostCopyBackend())
    if damage == "extent":
        owners = {(e.allocation_index, e.offset_bytes) for e in result.manifest.model_extents if e.sha256 == extent.sha256}
        assert (raised.value.allocation, raised.value.offset_bytes) in owners
    elif damage == "padding":
        assert raised.value.offset_bytes == _first_padding_offset(result) + 1
    else:
        assert damage in str(raised.value)
    assert raised.value.quarantined_to.parent.name == "quarantine"
    assert attempt.cache.wait_for_records(WAIT_SECONDS)
    assert not path.exists() and not cache.record_path(digest).exists()


def test_a_manifest_whose_pack_digest_is_not_its_extents_bytes_gets_no_record(tiny, caplog: pytest.LogCaptureFixture) -> None:
    """Bytes that match every extent and padding run of the layout but not the digest that names them (a
    manifest whose pack digest disagrees with its own extents) are admitted for that load, but the whole-file
    hash writes no record, logs an ERROR naming the file and rule ``pack-sha256``, and quarantines them, so no
    later start accepts them (catches a record written on the extents' word)."""
    _, _, result, cache = tiny
    wrong = "ab" * 32
    path = cache.object_path(wrong)
    os.rename(cache.object_path(result.manifest.pack.sha256), path)
    layout = check_manifest(result.manifest)
    assert cache.admit(wrong, layout.size_bytes, layout=layout) == path
    with caplog.at_level(logging.INFO, logger="coldsnap_core.cache.payload_cache"):
        cache.record_in_background()
        assert cache.wait_for_records(WAIT_SECONDS)
    assert not cache.record_path(wrong).exists() and not path.exists()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "rule pack-sha256 failed" in errors[0] and str(path) in errors[0]
    assert [p.name.split(".")[0] for p in cache.quarantined()] == [wrong]


def test_a_pack_replaced_while_its_whole_file_hash_runs_gets_no_record(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """The object renamed over (same bytes, another inode) while the background hash runs: the hash is of the
    old inode, so no record binds the new one, and the new one stays (catches a record bound to whatever is at
    the path when the hash ends)."""
    _, _, result, cache = tiny
    digest = result.manifest.pack.sha256
    path = cache.object_path(digest)
    layout = check_manifest(result.manifest)
    started, release = _block_the_whole_file_hash(monkeypatch)
    cache.admit(digest, layout.size_bytes, layout=layout)
    cache.record_in_background()
    assert started.wait(WAIT_SECONDS)
    replacement = path.with_name("replacement")
    shutil.copyfile(path, replacement)
    os.chmod(replacement, 0o444)
    os.replace(replacement, path)
    release.set()
    assert cache.wait_for_records(WAIT_SECONDS)
    assert path.exists() and not cache.record_path(digest).exists()


def test_cache_verify_without_a_layout_hashes_the_whole_file(tiny, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """``coldsnap cache verify`` has no manifest: it keeps the whole-file SHA-256 and writes the record before it
    returns (catches the per-extent path, or a deferred record, reaching a caller without a layout)."""
    _, _, result, cache = tiny

    def refused(*args, **kwargs):
        raise AssertionError("checked by extents without a layout")

    monkeypatch.setattr(payload_cache, "pack_matches_layout", refused)
    assert main(["cache", "verify", "--state-root", str(cache.state_root)]) == 0
    assert "full SHA-256" in capsys.readouterr().out
    assert record_state(cache, result.manifest.pack.sha256) == "trusted"


def test_a_damaged_copy_is_fetched_again_from_the_store_in_the_same_start(tiny, tmp_path: Path, caplog) -> None:
    """A record-less copy with a flipped extent byte, on a node whose payload store holds the pack: the copy is
    quarantined and the pack fetched again from the store in the same start, which restores every byte (catches a
    restore that refuses, or falls back to the checkpoint, although ``coldsnap doctor`` and ``coldsnap stage`` both
    say the store replaces a corrupt cached pack)."""
    from coldsnap_core.stores.local import LocalFolderStore

    checkpoint, loaded, result, cache = tiny
    digest = result.manifest.pack.sha256
    store_root = tmp_path / "store"
    (store_root / "model-payloads" / "sha256").mkdir(parents=True)
    shutil.copyfile(result.pack_path, store_root / "model-payloads" / "sha256" / f"{digest}.pack")
    extent = max(result.manifest.model_extents, key=lambda e: e.size_bytes)
    flip_byte(cache.object_path(digest), extent.pack_offset_bytes + 3)
    fresh = TinyModel()
    attempt = restorer(checkpoint, tmp_path / "artifact", tmp_path / "node", store=LocalFolderStore(store_root))
    with caplog.at_level(logging.WARNING):
        attempt.run(enumerate_allocations(fresh), HostCopyBackend())
    assert fresh.snapshot() == loaded.snapshot()
    assert [r for r in caplog.records if "is corrupt" in r.getMessage() and "fetching it again" in r.getMessage()]
    assert len(list(cache.quarantine_dir.iterdir())) == 1
    assert cache.object_path(digest).read_bytes() == result.pack_path.read_bytes()
    assert attempt.cache.wait_for_records(WAIT_SECONDS)
    assert record_state(cache, digest) == "trusted"
