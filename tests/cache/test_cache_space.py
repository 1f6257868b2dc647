"""A full file system in the middle of a write: a clear error, nothing eligible, nothing left behind.

Two real ways to run out of space: ``RLIMIT_FSIZE`` in a child process (the writer gets ``EFBIG``),
and a small real tmpfs mounted for the test (``ENOSPC``; needs root, which this machine has).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cache_support import child_command, eligible_objects, run_child, sha256_of, temporaries
from slabs import stage_checkpoint

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.materialize import materialize_payload
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.errors import InsufficientSpaceError
from coldsnap_core.restore.staging import stage_payload
from coldsnap_core.stores.local import LocalFolderStore


@contextlib.contextmanager
def tmpfs(mount_point: Path, size_bytes: int) -> Iterator[Path]:
    """Mount a real tmpfs of ``size_bytes`` at ``mount_point`` (root only) and unmount it afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount_point.mkdir(parents=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 0.99])
def test_rlimit_fsize_mid_write(captured, tmp_path: Path, fraction: float) -> None:
    """A writer whose file size limit is hit at 0 %, 50 % or 99 % of the pack reports
    InsufficientSpaceError (rule ``space``), no object is eligible and no temporary is left."""
    state = tmp_path / "state"
    limit = int(captured.pack.size_bytes * fraction)
    rc, report, err = run_child(child_command(captured.checkpoint, captured.artifact_dir, state, "--fsize-limit", str(limit)))
    assert rc == 1, err
    assert report["error"] == "InsufficientSpaceError"
    assert "rule space failed" in report["message"] and ".partial" in report["message"]
    assert eligible_objects(state) == {}
    assert temporaries(state) == []


def test_full_tmpfs_during_materialization(captured, tmp_path: Path) -> None:
    """On a real 512 KiB tmpfs the 1.2 MiB pack cannot fit: InsufficientSpaceError, nothing eligible,
    nothing left in ``tmp/``."""
    with tmpfs(tmp_path / "mnt", 512 << 10) as mnt:
        cache = PayloadCache(mnt / "state")
        slabs = stage_checkpoint(captured.checkpoint, slab_count=2)
        with pytest.raises(InsufficientSpaceError, match="No space left"):
            materialize_payload(captured.manifest, slabs.allocations, HostCopyBackend(threads=1), cache, mode="required")
        assert cache.digests() == []
        assert cache.temporaries() == []


def test_full_tmpfs_during_a_store_fetch(captured, tmp_path: Path) -> None:
    """Staging from a folder store into a full cache: InsufficientSpaceError, nothing eligible or
    left behind (the kernel-copy path maps ENOSPC too)."""
    store = LocalFolderStore(tmp_path / "store")
    store.upload(captured.pack_path, captured.pack.sha256, captured.pack.size_bytes)
    with tmpfs(tmp_path / "mnt", 512 << 10) as mnt:
        cache = PayloadCache(mnt / "state")
        with pytest.raises(InsufficientSpaceError):
            stage_payload(captured.pack, cache=cache, store=store)
        assert cache.digests() == []
        assert cache.temporaries() == []


def test_no_room_for_the_record_keeps_the_valid_object(captured, tmp_path: Path, caplog) -> None:
    """A tmpfs with room for the pack but not its record: the commit keeps the verified object
    (logging a WARNING); this cache object remembers the verification (no second hash in this
    process), and any other reader hashes it in full."""
    with tmpfs(tmp_path / "mnt", captured.pack.size_bytes) as mnt:
        cache = PayloadCache(mnt / "state")
        slabs = stage_checkpoint(captured.checkpoint, slab_count=2)
        with caplog.at_level(logging.WARNING):
            materialize_payload(captured.manifest, slabs.allocations, HostCopyBackend(threads=1), cache, mode="required")
        path = cache.object_path(captured.pack.sha256)
        assert sha256_of(path) == captured.pack.sha256
        assert not cache.record_path(captured.pack.sha256).exists()
        assert "validation record could not be written" in caplog.text
        assert cache.temporaries() == []
        hashed: list[int] = []
        assert cache.admit(captured.pack.sha256, progress=hashed.append) == path
        assert sum(hashed) == 0
        other = PayloadCache(mnt / "state")
        assert other.admit(captured.pack.sha256, progress=hashed.append) == path
        assert sum(hashed) == captured.pack.size_bytes


@contextlib.contextmanager
def read_only_cache(captured, tmp_path: Path) -> Iterator[PayloadCache]:
    """The captured pack in a cache on a real tmpfs, without record or lock files, remounted read-only
    (a shared, pre-filled mount; or a state copied elsewhere, whose records name another device)."""
    with tmpfs(tmp_path / "mnt", 8 << 20) as mnt:
        cache = PayloadCache(mnt / "state")
        slabs = stage_checkpoint(captured.checkpoint, slab_count=2)
        materialize_payload(captured.manifest, slabs.allocations, HostCopyBackend(threads=1), cache, mode="required")
        cache.record_path(captured.pack.sha256).unlink()
        for lock in cache.locks_dir.iterdir():
            lock.unlink()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        yield PayloadCache(mnt / "state")


def _coldsnap_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("coldsnap")]


def test_read_only_cache_admits_after_one_full_hash_without_warnings(captured, tmp_path: Path, caplog) -> None:
    """A read-only cache: an object without a record is hashed in full and admitted although neither
    the lock nor the record can be written; both are said once at INFO (no WARNING: nothing is wrong),
    and later admissions in this process do not hash again. Staging a missing pack into it fails with
    a clear CacheError, not a bare OSError."""
    from coldsnap_core.errors import CacheError
    from coldsnap_core.format.manifest import PackRef

    with read_only_cache(captured, tmp_path) as cache:
        hashed: list[int] = []
        with caplog.at_level(logging.INFO):
            assert cache.admit(captured.pack.sha256, captured.pack.size_bytes, progress=hashed.append) == cache.object_path(
                captured.pack.sha256
            )
            assert cache.admit(captured.pack.sha256, captured.pack.size_bytes, progress=hashed.append)
        assert sum(hashed) == captured.pack.size_bytes
        assert _coldsnap_warnings(caplog) == []
        assert "proceeding without it" in caplog.text and "read-only file system" in caplog.text
        store = LocalFolderStore(tmp_path / "store")
        store.upload(captured.pack_path, captured.pack.sha256, captured.pack.size_bytes)
        with pytest.raises(CacheError, match="Read-only file system"):
            stage_payload(
                PackRef.for_digest(captured.pack.sha256, captured.pack.size_bytes),
                cache=PayloadCache(cache.state_root.parent / "other"),
                store=store,
            )


def test_read_only_cache_restore_sequence_hashes_once_and_hydrates(captured, tmp_path: Path, caplog) -> None:
    """The restore path on a read-only state root whose pack verifies: the first-use verification with
    the manifest's layout and :func:`record_verified` (what ``coldsnap_core.restore.pipeline`` does), then
    staging, then hydration: one full hash in total, no WARNING, the allocations restored (the record
    write raised CacheError "cannot create a temporary file: Read-only file system", and ``auto``
    fell back to the checkpoint although the pack verified)."""
    from slabs import allocate

    from coldsnap_core.artifact.capsules import read_capsule
    from coldsnap_core.cache.records import record_verified
    from coldsnap_core.copy.host import host_view
    from coldsnap_core.format.allocation import LiveAllocation
    from coldsnap_core.format.verify import check_manifest, extent_owner_map, verify_pack_file
    from coldsnap_core.restore.hydrate import hydrate

    capsule = read_capsule(captured.artifact_dir / "workers" / "worker-0-of-1")
    manifest = capsule.native
    with read_only_cache(captured, tmp_path) as cache, caplog.at_level(logging.INFO):
        path = cache.object_path(manifest.pack.sha256)
        hashed: list[int] = []
        with cache.lock(manifest.pack.sha256):
            st = os.lstat(path)
            verify_pack_file(path, manifest.pack, check_manifest(manifest), extent_owner=extent_owner_map(manifest))
            assert record_verified(cache, manifest.pack.sha256, st) is False
        assert stage_payload(manifest.pack, cache=cache, progress=hashed.append) == path
        arrays = allocate(manifest.allocations)
        allocations = [LiveAllocation(i, int(a.ctypes.data), a.nbytes) for i, a in enumerate(arrays)]
        hydrate(manifest, blob_path=capsule.blob_path, cache=cache, allocations=allocations, backend=HostCopyBackend(threads=1))
        assert sum(hashed) == 0
        assert _coldsnap_warnings(caplog) == []
        assert "verifying" not in caplog.text
    slabs = stage_checkpoint(captured.checkpoint, slab_count=2)
    for extent in manifest.model_extents[:3]:
        restored = arrays[extent.allocation_index].view("uint8")[extent.offset_bytes : extent.offset_bytes + extent.size_bytes]
        source = slabs.allocations[extent.allocation_index]
        assert bytes(restored) == bytes(host_view(source.address + extent.offset_bytes, extent.size_bytes))


def test_read_only_cache_corrupt_object_fails_cleanly(captured, tmp_path: Path, caplog) -> None:
    """A corrupt object on a read-only cache: the verifier's PackDigestMismatchError (not a bare
    OSError from the quarantine's unlink/rename), one WARNING that it cannot be quarantined, and it
    is never admitted."""
    from cache_support import flip_byte

    from coldsnap_core.errors import PackDigestMismatchError

    with tmpfs(tmp_path / "mnt", 8 << 20) as mnt:
        cache = PayloadCache(mnt / "state")
        slabs = stage_checkpoint(captured.checkpoint, slab_count=2)
        materialize_payload(captured.manifest, slabs.allocations, HostCopyBackend(threads=1), cache, mode="required")
        flip_byte(cache.object_path(captured.pack.sha256), 100)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with caplog.at_level(logging.WARNING):
            with pytest.raises(PackDigestMismatchError):
                cache.admit(captured.pack.sha256, captured.pack.size_bytes)
            with pytest.raises(PackDigestMismatchError):
                cache.admit(captured.pack.sha256, captured.pack.size_bytes)
        assert "cannot be quarantined" in caplog.text
        assert cache.object_path(captured.pack.sha256).exists()


def test_efbig_is_a_space_error_everywhere(tmp_path: Path) -> None:
    """``EFBIG`` (a write past ``RLIMIT_FSIZE``; CPython ignores ``SIGXFSZ``) is "no space" in every
    layer: the one ``OSError`` table (``coldsnap_core._io.os_error``) maps it to
    ``InsufficientSpaceError`` whether the caller is a reader (default classes) or the cache's own
    folders (``CacheError`` for everything else). Fails if the cache keeps a second table that maps
    ``EFBIG`` to a generic ``CacheError`` (so ``auto`` reported a cache fault instead of a full disk)."""
    import errno
    import sys

    from coldsnap_core import _io
    from coldsnap_core.cache import payload_cache as cache_module
    from coldsnap_core.errors import CacheError, FileAccessError

    probe = tmp_path / "probe"
    script = (
        "import os, resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600)\n"
        "os.write(fd, bytes(4096))\n"
        "try:\n    os.write(fd, b'x')\nexcept OSError as exc:\n    print(exc.errno)\n"
    )
    child = subprocess.run([sys.executable, "-c", script, str(probe)], capture_output=True, text=True, check=True)
    real_errno = int(child.stdout)
    assert real_errno == errno.EFBIG
    exc = OSError(real_errno, os.strerror(real_errno), str(probe))
    cache_error = cache_module._os_error("cannot create a temporary file", exc, probe)
    assert type(cache_error) is InsufficientSpaceError, cache_error
    for error in (
        cache_error,
        _io.os_error("cannot write", exc, probe),
        _io.os_error("cannot write", exc, probe, missing=CacheError, other=CacheError),
    ):
        assert type(error) is InsufficientSpaceError and error.rule == "space" and str(probe) in str(error)
    eio = OSError(errno.EIO, os.strerror(errno.EIO), str(probe))
    assert type(cache_module._os_error("cannot commit the pack", eio, probe)) is CacheError
    assert type(_io.os_error("cannot read", eio, probe)) is FileAccessError
