"""The cache's admission rules: validation records, quarantine, symbolic links and digest checks.

Every test works on real files under ``tmp_path`` (objects committed by the real writer, records
written by the real code) and names the regression it catches.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cache_support import flip_byte, hydrate_captured, sha256_of

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cache.records import ValidationRecord, read_trusted_record, record_state, write_record
from coldsnap_core.errors import (
    CacheError,
    ExtentDigestMismatchError,
    InvalidDigestError,
    MissingObjectError,
    NotRegularFileError,
    PackDigestMismatchError,
    PackSizeMismatchError,
    UnsafePathError,
    ValidationRecordError,
)
from coldsnap_core.restore.staging import stage_payload
from coldsnap_core.stores.local import LocalFolderStore
from tests.support.files import raised_without_blocking

BAD_DIGESTS = [
    "../x",
    "A" * 64,
    "8DEEC00A23DB33CD96D64728A18B63BDBF0D87336A8B8199A7B9733767C577FA",
    "ab" * 31,
    "g" * 64,
    "",
    None,
    7,
]


class Hashed:
    """A progress callback that counts the bytes the verifier hashed."""

    def __init__(self) -> None:
        self.bytes = 0

    def __call__(self, n: int) -> None:
        self.bytes += n


def test_record_fast_path_does_not_hash(captured) -> None:
    """A committed object is admitted on its record without reading a byte (a regression that drops
    the record, or never trusts it, hashes here and the counter shows it)."""
    cache = PayloadCache(captured.capture_root)
    hashed = Hashed()
    assert cache.admit(captured.pack.sha256, captured.pack.size_bytes, progress=hashed) == captured.pack_path
    assert hashed.bytes == 0
    assert record_state(cache, captured.pack.sha256) == "trusted"


def test_record_fields_and_mode(captured) -> None:
    """The record is read-only JSON binding digest, device, inode, size, mtime and ctime (ns) to the object."""
    cache = PayloadCache(captured.capture_root)
    path = cache.record_path(captured.pack.sha256)
    st = os.lstat(path)
    assert stat.S_IMODE(st.st_mode) == 0o444
    doc = json.loads(path.read_bytes())
    obj = os.lstat(captured.pack_path)
    assert doc["format"] == "coldsnap.validation-record" and doc["format_version"] == 1
    assert doc["digest"] == captured.pack.sha256
    assert (doc["device"], doc["inode"], doc["size_bytes"], doc["mtime_ns"], doc["ctime_ns"]) == (
        obj.st_dev,
        obj.st_ino,
        obj.st_size,
        obj.st_mtime_ns,
        obj.st_ctime_ns,
    )
    assert doc["verifier_version"] == "coldsnap-verifier/1"
    assert sorted(doc) == sorted(
        [
            "format",
            "format_version",
            "digest",
            "device",
            "inode",
            "size_bytes",
            "mtime_ns",
            "ctime_ns",
            "verifier_version",
            "verified_at",
        ]
    )


def test_missing_record_means_full_hash_then_record(captured) -> None:
    """Without a record the object is hashed in full once, and the rewritten record makes the next
    admission free (catches a regression that never writes the record back)."""
    cache = PayloadCache(captured.capture_root)
    os.unlink(cache.record_path(captured.pack.sha256))
    hashed = Hashed()
    cache.admit(captured.pack.sha256, progress=hashed)
    assert hashed.bytes == captured.pack.size_bytes
    again = Hashed()
    cache.admit(captured.pack.sha256, progress=again)
    assert again.bytes == 0


def test_flipped_byte_with_changed_mtime_is_caught(captured) -> None:
    """A flipped byte whose write moved the mtime: the record no longer matches, the full hash fails,
    the object is quarantined with its record and the caller gets the verifier's error."""
    cache = PayloadCache(captured.capture_root)
    digest = captured.pack.sha256
    flip_byte(captured.pack_path, 4096 + 17)
    with pytest.raises(ValidationRecordError, match=r"mtime_ns|ctime_ns"):
        read_trusted_record(cache, digest)
    with pytest.raises(PackDigestMismatchError):
        cache.admit(digest, captured.pack.size_bytes)
    assert not captured.pack_path.exists()
    assert not cache.record_path(digest).exists()
    assert len(cache.quarantined()) == 1


def test_flipped_byte_with_changed_size_is_caught(captured) -> None:
    """An appended byte changes the size: the record check refuses it before any hashing, and the
    unverified object of the wrong size is quarantined (OCI: size before digest)."""
    cache = PayloadCache(captured.capture_root)
    os.chmod(captured.pack_path, 0o644)
    with open(captured.pack_path, "ab") as f:
        f.write(b"\x01")
    hashed = Hashed()
    with pytest.raises(PackSizeMismatchError, match="extended"):
        cache.admit(captured.pack.sha256, captured.pack.size_bytes, progress=hashed)
    assert hashed.bytes == 0
    assert not captured.pack_path.exists()


def test_flipped_byte_with_restored_mtime_is_caught_by_ctime(captured) -> None:
    """An edit that restores the size and the mtime (``os.utime``) still moves the ctime, which the
    record binds: the full hash runs and fails (catches a record that binds only size and mtime)."""
    cache = PayloadCache(captured.capture_root)
    before = os.lstat(captured.pack_path)
    flip_byte(captured.pack_path, 100)
    os.utime(captured.pack_path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.lstat(captured.pack_path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with pytest.raises(ValidationRecordError, match="ctime_ns"):
        read_trusted_record(cache, captured.pack.sha256)
    with pytest.raises(PackDigestMismatchError):
        cache.admit(captured.pack.sha256)


def test_record_limit_is_covered_by_extent_verification_during_hydration(captured) -> None:
    """The documented limit: an edit that leaves every bound field as recorded (simulated by
    re-binding the record after the edit, as someone who can also set the clock could) is admitted,
    and ``hydrate(verify_extents=True)`` is what catches it, naming the allocation."""
    cache = PayloadCache(captured.capture_root)
    digest = captured.pack.sha256
    extent = captured.manifest.model_extents[0]
    flip_byte(captured.pack_path, extent.pack_offset_bytes + 5)
    write_record(cache, digest, os.lstat(captured.pack_path))
    assert cache.admit(digest, captured.pack.size_bytes) == captured.pack_path
    with pytest.raises(ExtentDigestMismatchError) as info:
        hydrate_captured(captured, cache, verify_extents=True)
    assert info.value.allocation is not None


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666])
def test_record_with_loose_mode_is_not_trusted(captured, mode: int) -> None:
    """A group- or world-writable record is ignored: the object is re-hashed and the record is
    rewritten read-only (catches a mode check that is missing or only looks at the owner bits)."""
    cache = PayloadCache(captured.capture_root)
    record = cache.record_path(captured.pack.sha256)
    os.chmod(record, mode)
    with pytest.raises(ValidationRecordError, match="writable"):
        read_trusted_record(cache, captured.pack.sha256)
    hashed = Hashed()
    cache.admit(captured.pack.sha256, progress=hashed)
    assert hashed.bytes == captured.pack.size_bytes
    assert stat.S_IMODE(os.lstat(record).st_mode) == 0o444


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("inode", lambda v: v + 1),
        ("device", lambda v: v + 1),
        ("size_bytes", lambda v: v + 4096),
        ("mtime_ns", lambda v: v - 1),
        ("ctime_ns", lambda v: v + 1),
        ("digest", lambda v: "0" * 64),
        ("verifier_version", lambda v: "coldsnap-verifier/0"),
        ("format_version", lambda v: 2),
        ("extra", lambda v: 1),
    ],
)
def test_record_with_edited_field_is_not_trusted(captured, field: str, change) -> None:
    """An edited record (mode restored to 0444) is not trusted: every bound field, the digest, the
    verifier version, the format version and unknown keys are each checked."""
    cache = PayloadCache(captured.capture_root)
    record = cache.record_path(captured.pack.sha256)
    doc = json.loads(record.read_bytes())
    doc[field] = change(doc.get(field))
    os.chmod(record, 0o644)
    record.write_text(json.dumps(doc))
    os.chmod(record, 0o444)
    with pytest.raises(ValidationRecordError):
        read_trusted_record(cache, captured.pack.sha256)
    hashed = Hashed()
    cache.admit(captured.pack.sha256, progress=hashed)
    assert hashed.bytes == captured.pack.size_bytes
    assert record_state(cache, captured.pack.sha256) == "trusted"


def test_record_of_another_user_is_not_trusted(captured) -> None:
    """A record owned by another uid is ignored (we run as root here, so ``chown`` is real)."""
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    cache = PayloadCache(captured.capture_root)
    os.chown(cache.record_path(captured.pack.sha256), 12345, 12345)
    with pytest.raises(ValidationRecordError, match="uid 12345"):
        read_trusted_record(cache, captured.pack.sha256)


SWAPPER = """
import os, sys
path, regular, fifo = sys.argv[1:4]
swap = path + ".swap"
while True:
    for source in (fifo, regular):
        os.link(source, swap)
        os.replace(swap, path)
"""
"""Swaps ``path`` between two inodes for ever: hard links to ``regular`` and to ``fifo``, renamed in."""


def test_a_named_pipe_swapped_in_for_a_record_never_blocks_its_reader(captured, tmp_path: Path) -> None:
    """A same-user process swaps a validation record's path between the record and a named pipe while the
    record is read at least 2,000 times: each read trusts the record or refuses the pipe as not a regular file, and
    none waits for a writer. Fails if the reader examines the path (``lstat``) and then opens it blocking:
    a pipe renamed in between is opened, and the restore waits for ever holding the digest's lock."""
    cache = PayloadCache(captured.capture_root)
    digest = captured.pack.sha256
    path = cache.record_path(digest)
    regular, fifo = tmp_path / "record", tmp_path / "pipe"
    os.link(path, regular)
    os.mkfifo(fifo)
    seen: dict[str, int] = {}
    stop = threading.Event()

    def read_many() -> None:
        # At least 2,000 reads, and on until the swapper (a process that may start late on a busy machine) has
        # put the pipe in place at least once.
        for count in range(200_000):
            if stop.is_set() or (count >= 2000 and seen.get("refused", 0) > 0):
                return
            try:
                read_trusted_record(cache, digest)
                outcome = "trusted"
            except NotRegularFileError:
                outcome = "refused"
            seen[outcome] = seen.get(outcome, 0) + 1

    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(path), str(regular), str(fifo)])
    try:
        error = raised_without_blocking(read_many, fifo, stop=stop)
    finally:
        swapper.kill()
        swapper.wait()
    assert error is None, error
    assert sum(seen.values()) >= 2000 and seen.get("refused", 0) > 0, seen


def test_malformed_and_oversized_records_are_not_trusted(captured) -> None:
    """Garbage JSON and a huge record are refused without trusting anything."""
    cache = PayloadCache(captured.capture_root)
    record = cache.record_path(captured.pack.sha256)
    os.chmod(record, 0o644)
    record.write_text("{not json")
    with pytest.raises(ValidationRecordError, match="malformed"):
        read_trusted_record(cache, captured.pack.sha256)
    record.write_bytes(b" " * (70 << 10))
    with pytest.raises(ValidationRecordError, match="more than"):
        read_trusted_record(cache, captured.pack.sha256)


def test_loose_object_mode_is_not_trusted_and_is_tightened(captured) -> None:
    """A world-writable object is not admitted on its record; after a full hash it is 0444 again."""
    cache = PayloadCache(captured.capture_root)
    os.chmod(captured.pack_path, 0o666)
    with pytest.raises(ValidationRecordError, match="object mode"):
        read_trusted_record(cache, captured.pack.sha256)
    cache.admit(captured.pack.sha256)
    assert stat.S_IMODE(os.lstat(captured.pack_path).st_mode) == 0o444
    assert record_state(cache, captured.pack.sha256) == "trusted"


def test_trusted_object_of_other_size_is_not_quarantined(captured) -> None:
    """When the record vouches for the object, a caller expecting another size gets an error, and
    the good object stays (a wrong manifest must not evict a verified pack)."""
    cache = PayloadCache(captured.capture_root)
    with pytest.raises(PackSizeMismatchError, match="verified against its digest"):
        cache.admit(captured.pack.sha256, captured.pack.size_bytes + 4096)
    assert captured.pack_path.exists()


def test_object_changed_during_verification_is_not_admitted(captured) -> None:
    """If the object's identity changes while it is hashed, no record is written and admission fails."""
    cache = PayloadCache(captured.capture_root)
    digest = captured.pack.sha256
    os.unlink(cache.record_path(digest))

    def touch(_: int) -> None:
        os.utime(captured.pack_path)

    with pytest.raises(CacheError, match="changed while it was being verified"):
        cache.admit(digest, progress=touch)
    assert not cache.record_path(digest).exists()
    assert captured.pack_path.exists()


def test_missing_object(cache: PayloadCache) -> None:
    """Absent object: MissingObjectError (exit code 3), before and after the cache exists."""
    digest = "0" * 64
    with pytest.raises(MissingObjectError):
        cache.admit(digest)
    cache.ensure_dirs()
    with pytest.raises(MissingObjectError):
        cache.admit(digest)


# --- symbolic links -----------------------------------------------------------------------------------


def test_symlink_at_object_path_is_refused(captured, tmp_path: Path) -> None:
    """A link at the object path is refused even if it points at a correct copy of the pack."""
    cache = PayloadCache(captured.capture_root)
    good = tmp_path / "elsewhere.pack"
    good.write_bytes(captured.pack_path.read_bytes())
    os.unlink(captured.pack_path)
    os.symlink(good, captured.pack_path)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        cache.admit(captured.pack.sha256)


def test_symlink_at_record_path_is_refused(captured, tmp_path: Path) -> None:
    """A link at the record path (even to a copy of the genuine record) is refused."""
    cache = PayloadCache(captured.capture_root)
    record = cache.record_path(captured.pack.sha256)
    copy = tmp_path / "record.json"
    copy.write_bytes(record.read_bytes())
    os.unlink(record)
    os.symlink(copy, record)
    with pytest.raises(UnsafePathError):
        cache.admit(captured.pack.sha256)


def test_symlink_at_lock_path_is_refused_and_target_untouched(captured, tmp_path: Path) -> None:
    """A link planted at the lock path (CVE-2025-68146's attack) is refused; the victim keeps its bytes."""
    cache = PayloadCache(captured.capture_root)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    lock = cache.lock_path(captured.pack.sha256)
    lock.parent.mkdir(parents=True, exist_ok=True)
    if lock.exists():
        os.unlink(lock)
    os.symlink(victim, lock)
    os.unlink(cache.record_path(captured.pack.sha256))  # force the locked (full-hash) path
    with pytest.raises(UnsafePathError):
        cache.admit(captured.pack.sha256)
    with pytest.raises(UnsafePathError), cache.lock(captured.pack.sha256):
        pass
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("folder", ["model-payloads", "model-payloads/sha256", "model-payloads/tmp", "model-payloads/locks"])
def test_symlinked_cache_folder_is_refused(captured, tmp_path: Path, folder: str) -> None:
    """A cache folder below the state root replaced by a link is refused by readers and writers."""
    root = captured.capture_root
    target = root / folder
    moved = tmp_path / "moved"
    os.rename(target, moved)
    os.symlink(moved, target)
    cache = PayloadCache(root)
    with pytest.raises(UnsafePathError, match="folder"):
        cache.ensure_dirs()
    with pytest.raises(UnsafePathError):
        if folder.endswith(("tmp", "locks")):
            with cache.temporary("capture"):
                pass
        else:
            cache.admit(captured.pack.sha256)


def test_state_root_itself_may_be_a_symlink(captured, tmp_path: Path) -> None:
    """The state root may be a link (``~/.cache/coldsnap -> /nvme/coldsnap``); only folders below it are checked."""
    link = tmp_path / "root-link"
    os.symlink(captured.capture_root, link)
    assert PayloadCache(link).admit(captured.pack.sha256).name == f"{captured.pack.sha256}.pack"


# --- digests before paths ----------------------------------------------------------------------------


@pytest.mark.parametrize("digest", BAD_DIGESTS)
def test_bad_digest_is_rejected_before_any_file_is_touched(tmp_path: Path, digest) -> None:
    """``../x``, uppercase hex, short or non-hex digests raise InvalidDigestError from every entry
    point, and the state root is never even created."""
    from coldsnap_core.format.manifest import PackRef

    root = tmp_path / "never-created"
    cache = PayloadCache(root)
    calls = [
        lambda: cache.object_path(digest),
        lambda: cache.record_path(digest),
        lambda: cache.lock_path(digest),
        lambda: cache.admit(digest),
        lambda: cache.reverify(digest),
        lambda: cache.quarantine(digest),
        lambda: cache.lock(digest).__enter__(),
        lambda: stage_payload(PackRef(name=f"model-payloads/sha256/{digest}.pack", size_bytes=4096, sha256=digest), cache=cache),
        lambda: LocalFolderStore(tmp_path / "store").has(digest),
    ]
    for call in calls:
        with pytest.raises(InvalidDigestError):
            call()
    assert not root.exists()
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("label", ["../x", ".hidden", "A", "a/b", ""])
def test_bad_temporary_label_is_rejected(cache: PayloadCache, label: str) -> None:
    """Temporary-file labels are validated like digests, so no caller can steer a path."""
    with pytest.raises(InvalidDigestError), cache.temporary(label):
        pass
    assert not cache.state_root.exists()


# --- commit -------------------------------------------------------------------------------------------


def test_commit_refuses_wrong_size_and_wrong_digest(cache: PayloadCache) -> None:
    """Size is checked before the digest; both failures keep nothing (no object, no temporary)."""
    data = b"x" * 8192
    digest = __import__("hashlib").sha256(data).hexdigest()
    with pytest.raises(PackSizeMismatchError), cache.temporary("capture") as (fd, path):
        os.write(fd, data)
        cache.commit(fd, path, sha256=digest, size_bytes=4096)
    with pytest.raises(PackDigestMismatchError), cache.temporary("capture") as (fd, path):
        os.write(fd, data)
        cache.commit(fd, path, sha256=digest, size_bytes=8192, expected_sha256="1" * 64)
    assert cache.digests() == [] and cache.temporaries() == []


def test_commit_refuses_a_replaced_temporary(cache: PayloadCache) -> None:
    """If the temporary's name no longer holds the written inode, nothing is renamed."""
    data = b"y" * 4096
    digest = __import__("hashlib").sha256(data).hexdigest()
    with pytest.raises(CacheError, match="removed or replaced"), cache.temporary("capture") as (fd, path):
        os.write(fd, data)
        os.unlink(path)
        path.write_bytes(data)
        cache.commit(fd, path, sha256=digest, size_bytes=4096)
    assert cache.digests() == []


def test_commit_replaces_a_corrupt_existing_object(captured, caplog: pytest.LogCaptureFixture) -> None:
    """A new commit over a corrupt object publishes the verified bytes and a record bound to them,
    without hashing the old object first."""
    cache = PayloadCache(captured.capture_root)
    digest = captured.pack.sha256
    good = captured.pack_path.read_bytes()
    flip_byte(captured.pack_path, 3)
    with caplog.at_level(logging.INFO), cache.temporary(digest) as (fd, path):
        os.write(fd, good)
        cache.commit(fd, path, sha256=digest, size_bytes=len(good), expected_sha256=digest)
    assert sha256_of(captured.pack_path) == digest
    assert record_state(cache, digest) == "trusted"
    assert "replacing" in caplog.text and "verifying" not in caplog.text


def test_recapture_repairs_a_corrupt_object_its_record_vouches_for(captured, tiny_checkpoint: Path) -> None:
    """The record's documented limit (an in-place edit re-bound by a forged record, as someone who
    can set the clock could) does not survive a re-capture: the commit installs its freshly written
    file, whose SHA-256 it computed from the bytes and which equals the name, instead of keeping the
    existing object on its record's word (it kept the corrupt object, trusted)."""
    from cache_support import capture

    cache = PayloadCache(captured.capture_root)
    digest = captured.pack.sha256
    flip_byte(captured.pack_path, captured.manifest.model_extents[0].pack_offset_bytes + 9)
    write_record(cache, digest, os.lstat(captured.pack_path))
    assert record_state(cache, digest) == "trusted"
    capture(tiny_checkpoint, captured.artifact_dir, captured.capture_root)
    assert sha256_of(captured.pack_path) == digest
    assert record_state(cache, digest) == "trusted"
    assert cache.quarantined() == []


def test_validation_record_dataclass_roundtrip(captured) -> None:
    """The record parses back into the same dataclass (strict parser, no lost field)."""
    cache = PayloadCache(captured.capture_root)
    record = read_trusted_record(cache, captured.pack.sha256)
    again = ValidationRecord.loads(json.dumps(record.to_json()))
    assert again == record
