"""The model identity on real files: the configuration digest and the node-local checkpoint records.

The configuration digest is computed from the real SmolLM2 ``config.json`` as ``transformers``
loads it; checkpoint records are written by hashing the real 2-layer checkpoint (QA defects 2, 3, 5).
Repository commits are resolved by the real ``huggingface_hub`` in a real Hugging Face cache folder
built under ``tmp_path`` with the layout of huggingface_hub's caching guide (``blobs/``, ``refs/``,
``snapshots/<commit>/`` links); nothing reaches the network.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import transformers

from coldsnap_core.errors import ModelIdentityMismatchError, UnsafePathError
from coldsnap_core.identity.checkpoint_records import CheckpointRecords, RecordState
from coldsnap_core.identity.config_digest import canonical_model_config, model_config_sha256
from coldsnap_core.identity.hub_commit import resolve_hub_commit
from coldsnap_core.identity.model_identity import LoadedModel, check_model_identity, identify_checkpoint

REPO_ID = "org/name"
COMMIT_A = "0123456789abcdef0123456789abcdef01234567"
COMMIT_B = "fedcba9876543210fedcba9876543210fedcba98"


def hub_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], *, ref: str | None = "main") -> Path:
    """Add ``files`` as snapshot ``commit`` of ``repo_id`` to the Hugging Face cache ``cache`` (each a
    relative link to ``blobs/<sha256>``, as ``hf_hub_download`` leaves them) and point ``refs/<ref>`` at
    it, as a download of ``ref`` that found ``commit`` upstream does. Returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(smollm2_2layer: Path, tmp_path: Path) -> Path:
    """A Hugging Face cache holding ``org/name`` at COMMIT_A (``main``): the 2-layer config and a small
    safetensors file."""
    cache = tmp_path / "hf-cache"
    files = {"config.json": (smollm2_2layer / "config.json").read_bytes(), "model.safetensors": b"\x08" + b"\0" * 7 + b"{}      "}
    hub_snapshot(cache, REPO_ID, COMMIT_A, files)
    return cache


@pytest.fixture(scope="module")
def hf_config(smollm2_2layer: Path) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.from_pretrained(smollm2_2layer)


def test_config_digest_sees_values_the_layout_cannot(hf_config, smollm2_2layer: Path, tmp_path: Path) -> None:
    """QA defect 2: another ``rope_theta`` (through ``rope_parameters``, or an overriding attribute as
    vLLM's ``--hf-overrides`` sets it), another dtype or quantization changes the digest; the same config read
    from another path (``_name_or_path``) or written by another transformers version does not."""
    base = model_config_sha256(hf_config, dtype="bfloat16")
    copy_dir = tmp_path / "elsewhere"
    shutil.copytree(smollm2_2layer, copy_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    moved = transformers.AutoConfig.from_pretrained(copy_dir)
    assert moved._name_or_path != hf_config._name_or_path
    moved.transformers_version = "0.0.1"
    assert model_config_sha256(moved, dtype="bfloat16") == base

    rope = transformers.AutoConfig.from_pretrained(smollm2_2layer)
    rope.rope_parameters = {**rope.rope_parameters, "rope_theta": 5000.0}
    overridden = transformers.AutoConfig.from_pretrained(smollm2_2layer)
    overridden.rope_theta = 5000.0  # what vLLM's --hf-overrides '{"rope_theta": 5000}' does
    digests = {
        model_config_sha256(rope, dtype="bfloat16"),
        model_config_sha256(overridden, dtype="bfloat16"),
        model_config_sha256(hf_config, dtype="float32"),
        model_config_sha256(hf_config, dtype="bfloat16", quantization="fp8"),
    }
    assert len(digests) == 4 and base not in digests


def test_config_digest_is_canonical(hf_config) -> None:
    """Catches a digest that depends on attribute order, a torch dtype's spelling or memory addresses:
    a mapping with the same content in another order, and the ``torch.bfloat16`` object, give the
    same canonical JSON; an object without a stable ``repr`` is written by its type name."""
    import torch

    as_mapping = dict(reversed(list(vars(hf_config).items())))
    assert canonical_model_config(as_mapping, dtype=torch.bfloat16) == canonical_model_config(hf_config, dtype="bfloat16")
    assert '"dtype":"bfloat16"' in canonical_model_config(hf_config, dtype=torch.bfloat16)
    assert "0x" not in canonical_model_config({"hook": object()}, dtype="bfloat16")


def test_identify_checkpoint_normalizes_the_folder_and_records_each_file(smollm2_2layer: Path, tmp_path: Path) -> None:
    """QA defects 3 and 5: the identity names a local folder by its real path (``$M/`` and a link to
    ``$M`` give the same identity) and writes one trusted checkpoint record per file, bound to its
    ``stat``, so that a later restore on this node knows the files' digests without reading them."""
    link = tmp_path / "link"
    link.symlink_to(smollm2_2layer)
    records = CheckpointRecords(tmp_path / "state")
    files = [link / "model.safetensors"]
    a = identify_checkpoint(files, source=f"{smollm2_2layer}/", root=link, records=records)
    b = identify_checkpoint(files, source=str(link), root=link)
    assert a == b and a.source == os.path.realpath(smollm2_2layer)
    lookup = records.lookup(link / "model.safetensors")
    assert lookup.state is RecordState.TRUSTED and lookup.sha256 == a.files[0].sha256
    assert oct(os.stat(records.folder).st_mode & 0o777) == "0o700"


def test_a_rewritten_file_makes_its_record_stale(tmp_path: Path) -> None:
    """QA defect 3: a file rewritten with other bytes of the same size no longer matches its record
    (``stat`` changed), so restore cannot take the recorded digest for it; a record that is not
    trusted (group-writable, or another file's) counts as absent; a linked records folder is refused."""
    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_bytes(b"a" * 4096)
    records = CheckpointRecords(tmp_path / "state")
    identify_checkpoint([checkpoint], source=str(tmp_path), records=records)
    assert records.lookup(checkpoint).state is RecordState.TRUSTED
    checkpoint.write_bytes(b"b" * 4096)
    stale = records.lookup(checkpoint)
    assert stale.state is RecordState.STALE and "changed since it was hashed" in stale.reason

    record = records.record_path(os.path.realpath(checkpoint))
    os.chmod(record, 0o664)
    assert records.lookup(checkpoint).state is RecordState.ABSENT
    os.chmod(record, 0o444)
    other = tmp_path / "other.safetensors"
    other.write_bytes(b"b" * 4096)
    shutil.copy2(record, records.record_path(os.path.realpath(other)))
    assert records.lookup(other).state is RecordState.ABSENT

    moved = tmp_path / "moved-records"
    os.rename(records.folder, moved)
    records.folder.symlink_to(moved)
    with pytest.raises(UnsafePathError):
        records.lookup(checkpoint)


# --- repository commits -----------------------------------------------------------------------------


def test_resolve_hub_commit_reads_the_cache(hub_cache: Path, tmp_path: Path) -> None:
    """QA (repository id without ``--revision``): catches a resolver that returns the revision as given
    (``None``/``main``) instead of the commit, that looks in ``HF_HUB_CACHE`` instead of ``cache_dir``, or
    that prefers the cache's ``refs/main`` over a commit vLLM already resolved (a
    ``huggingface_hub.ResolvedRevision``). An explicit commit comes back unchanged, cached or not; an
    unknown repository, an unknown branch, or a ``refs`` entry that is not a commit give ``None``."""
    assert resolve_hub_commit(REPO_ID, None, cache_dir=hub_cache) == COMMIT_A
    assert resolve_hub_commit(REPO_ID, "main", cache_dir=hub_cache) == COMMIT_A
    assert resolve_hub_commit(REPO_ID, COMMIT_B, cache_dir=hub_cache) == COMMIT_B
    assert resolve_hub_commit(REPO_ID, None, cache_dir=tmp_path / "empty") is None
    assert resolve_hub_commit("org/unknown", None, cache_dir=hub_cache) is None
    assert resolve_hub_commit(REPO_ID, "dev", cache_dir=hub_cache) is None
    engine = huggingface_hub.ResolvedRevision(resolved=COMMIT_B, initial=None, repo_id=REPO_ID)
    assert resolve_hub_commit(REPO_ID, engine, cache_dir=hub_cache) == COMMIT_B
    (hub_cache / "models--org--name" / "refs" / "broken").write_text("not a commit")
    assert resolve_hub_commit(REPO_ID, "broken", cache_dir=hub_cache) is None


def test_a_moved_main_is_refused(hub_cache: Path, tmp_path: Path) -> None:
    """The QA defect: an artifact captured from ``org/name`` (no ``--revision``) kept restoring the old
    weights after upstream ``main`` got a new commit with the same layout and config, because only
    ``(source, revision=None)`` was compared. Now the identity records COMMIT_A, and once ``refs/main``
    moves to COMMIT_B the check raises ModelIdentityMismatchError naming both commits. The same
    commit passes (before the move, and pinned with ``--revision COMMIT_A`` after it)."""
    snapshot = hub_cache / "models--org--name" / "snapshots" / COMMIT_A
    recorded = identify_checkpoint(
        [snapshot / "model.safetensors"], source=REPO_ID, revision=resolve_hub_commit(REPO_ID, None, cache_dir=hub_cache)
    )
    assert recorded.revision == COMMIT_A
    loaded = LoadedModel.from_config(REPO_ID, None, cache_dir=hub_cache)
    assert (loaded.revision, loaded.folder, loaded.requested_revision) == (COMMIT_A, None, None)
    check_model_identity(recorded, loaded)

    hub_snapshot(hub_cache, REPO_ID, COMMIT_B, {p.name: p.read_bytes() for p in snapshot.iterdir()})
    moved = LoadedModel.from_config(REPO_ID, None, cache_dir=hub_cache)
    with pytest.raises(ModelIdentityMismatchError, match="resolved to another commit") as raised:
        check_model_identity(recorded, moved, file="artifact.json")
    assert COMMIT_A in str(raised.value) and COMMIT_B in str(raised.value) and raised.value.rule == "model-identity"
    # one remedy, naming the flag and the commit to pin (not a second one inline in the cause)
    assert str(raised.value).count("remedy:") == 1 and raised.value.remedy.count(f"--revision {COMMIT_A}") == 1
    check_model_identity(recorded, LoadedModel.from_config(REPO_ID, COMMIT_A, cache_dir=hub_cache))


def test_an_unresolvable_revision_fails_closed(hub_cache: Path, tmp_path: Path) -> None:
    """Fail closed both ways: an artifact that recorded a commit, restored by an engine whose cache cannot
    resolve the revision (no cache, or another ``--download-dir``), is refused (catches a check that skips
    unresolvable revisions); an artifact that recorded no commit (captured before commits were recorded)
    is refused once the engine's revision resolves to one (catches a check that accepts ``None``)."""
    recorded = identify_checkpoint(
        [hub_cache / "models--org--name" / "snapshots" / COMMIT_A / "model.safetensors"], source=REPO_ID, revision=COMMIT_A
    )
    unresolved = LoadedModel.from_config(REPO_ID, None, cache_dir=tmp_path / "empty")
    assert unresolved.revision is None
    with pytest.raises(ModelIdentityMismatchError, match="does not resolve to a commit"):
        check_model_identity(recorded, unresolved)
    legacy = identify_checkpoint([hub_cache / "models--org--name" / "snapshots" / COMMIT_A / "model.safetensors"], source=REPO_ID)
    with pytest.raises(ModelIdentityMismatchError, match="not a commit hash"):
        check_model_identity(legacy, LoadedModel.from_config(REPO_ID, None, cache_dir=hub_cache))


def test_the_files_the_engine_would_read_must_be_the_recorded_ones(tmp_path: Path) -> None:
    """Catches a local-folder identity that only checks the recorded files: when the engine says
    which files it would read, an added one and a dropped one are each refused (named); the same set
    in another order passes."""
    for name in ("a.safetensors", "b.safetensors"):
        (tmp_path / name).write_bytes(name.encode() * 64)
    recorded = identify_checkpoint([tmp_path / "a.safetensors", tmp_path / "b.safetensors"], source=str(tmp_path))
    same = LoadedModel.from_config(str(tmp_path), None, checkpoint_files=["b.safetensors", "a.safetensors"])
    check_model_identity(recorded, same)
    added = LoadedModel.from_config(str(tmp_path), None, checkpoint_files=["a.safetensors", "b.safetensors", "c.safetensors"])
    with pytest.raises(ModelIdentityMismatchError, match=r"not recorded: \['c.safetensors'\]"):
        check_model_identity(recorded, added)
    dropped = LoadedModel.from_config(str(tmp_path), None, checkpoint_files=["a.safetensors"])
    with pytest.raises(ModelIdentityMismatchError, match=r"not read by the engine now: \['b.safetensors'\]"):
        check_model_identity(recorded, dropped)


# --- the content fingerprint (docs/format.md §10.2) ------------------------------------------------


def _synthetic_safetensors(path: Path, data_bytes: int) -> int:
    """A safetensors-shaped file: an 8-byte length, a JSON header padded to 8 bytes, then ``data_bytes``
    bytes ``(7i + 3) mod 256``. Returns the header end (``8 + N``)."""
    import json
    import struct

    header = json.dumps({"w": {"dtype": "U8", "shape": [data_bytes], "data_offsets": [0, data_bytes]}}).encode()
    header += b" " * (-len(header) % 8)
    data = bytes((7 * i + 3) % 256 for i in range(256)) * (data_bytes // 256) + bytes(
        (7 * i + 3) % 256 for i in range(data_bytes % 256)
    )
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return 8 + len(header)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_fingerprint_ranges_are_the_documented_ones() -> None:
    """Catches drift from docs/format.md §10.2: the header range, 16 blocks of 128 KiB from the data
    start to the file end, the whole file when the data is at most 2 MiB, no header for a non-safetensors
    length."""
    from coldsnap_core.identity.fingerprint import FINGERPRINT_BLOCK_BYTES, fingerprint_ranges

    block = FINGERPRINT_BLOCK_BYTES
    assert block == 131_072
    ranges = fingerprint_ranges(100 * 2**20, 88)
    assert ranges[0] == (0, 96) and len(ranges) == 17
    assert ranges[1] == (96, block) and ranges[-1] == (100 * 2**20 - block, block)
    assert ranges[2] == (96 + (100 * 2**20 - 96 - block) // 15, block)
    assert fingerprint_ranges(96 + 2 * 2**20, 88) == [(0, 96 + 2 * 2**20)]
    assert fingerprint_ranges(10 * 2**20, 2**62)[0] == (0, block)  # not a safetensors length: no header range
    assert fingerprint_ranges(0, None) == []


def test_fingerprint_golden_and_what_it_sees(tmp_path: Path) -> None:
    """A fixed 5 MiB safetensors-shaped file has a pinned fingerprint (catches any change to the domain,
    the ranges or their order). A byte changed in the header or in a sampled block changes it; a byte
    between two blocks does not (the documented limit: the full SHA-256 sees it); in a small file every
    byte counts."""
    from coldsnap_core.identity.fingerprint import FINGERPRINT_BLOCK_BYTES, checkpoint_fingerprint, fingerprint_ranges

    path = tmp_path / "model.safetensors"
    header_end = _synthetic_safetensors(path, 5 * 2**20)
    golden = checkpoint_fingerprint(path)
    assert golden == GOLDEN_FINGERPRINT
    ranges = fingerprint_ranges(path.stat().st_size, header_end - 8)
    for offset in (20, ranges[5][0] + 1000, ranges[-1][0] + FINGERPRINT_BLOCK_BYTES - 1):
        _flip(path, offset)
        assert checkpoint_fingerprint(path) != golden, offset
        _flip(path, offset)
    between = ranges[5][0] + FINGERPRINT_BLOCK_BYTES + 10
    assert between < ranges[6][0]
    _flip(path, between)
    assert checkpoint_fingerprint(path) == golden
    small = tmp_path / "small.safetensors"
    _synthetic_safetensors(small, 2**20)
    before = checkpoint_fingerprint(small)
    _flip(small, small.stat().st_size - 1)
    assert checkpoint_fingerprint(small) != before


GOLDEN_FINGERPRINT = "bf3ef532bed7214e3450e32dc8daba49049bcb05168bc7f61777b753babc4a56"
"""Of the 5 MiB file of ``_synthetic_safetensors``, also computed by hand from docs/format.md §10.2 with hashlib."""


def test_an_unreadable_hub_cache_is_named_instead_of_meaning_no_commit(tmp_path: Path) -> None:
    """A Hugging Face cache whose ``refs/main`` exists but cannot be read (``EACCES``) used to be "no
    commit" (logged at DEBUG), and the user then read "does not resolve to a commit". Now it is a
    ``FileAccessError`` naming the file; a missing entry is still ``None``. Fails if any ``OSError``
    other than "no such file" is turned into "no commit"."""
    import subprocess
    import sys

    from tests.support.files import permissions_enforced

    commit = "a" * 40
    repo = tmp_path / "models--org--name"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    script = (
        "import sys\n"
        "from coldsnap_core.errors import FileAccessError\n"
        "from coldsnap_core.identity.hub_commit import resolve_hub_commit\n"
        "print(resolve_hub_commit('org/missing', None, cache_dir=sys.argv[1]))\n"
        "try:\n"
        "    print(resolve_hub_commit('org/name', None, cache_dir=sys.argv[1]))\n"
        "except FileAccessError as exc:\n"
        "    print('FileAccessError', exc.file)\n"
    )
    command = permissions_enforced([sys.executable, "-c", script, str(tmp_path)])
    assert subprocess.run(command, capture_output=True, text=True, timeout=60).stdout.split() == ["None", commit]
    os.chmod(repo / "refs" / "main", 0)
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["None", "FileAccessError", str(repo / "refs" / "main")], done.stdout + done.stderr


def test_an_unreadable_driver_version_file_is_an_error_not_no_driver(tmp_path: Path) -> None:
    """``nvidia_driver_version`` maps only a missing file to "no driver"; a file that cannot be read (here a
    folder at the path) is a typed error naming it (``NotRegularFileError``) and is not cached, so a
    node does not capture an overlay for a target without a driver. Fails if any ``OSError`` means None."""
    from coldsnap_core.errors import NotRegularFileError
    from coldsnap_core.identity.target import nvidia_driver_version

    assert nvidia_driver_version(tmp_path / "absent") is None
    there = tmp_path / "version"
    there.mkdir()
    with pytest.raises(NotRegularFileError, match="NVIDIA driver version") as raised:
        nvidia_driver_version(there)
    assert raised.value.file == str(there) or str(there) in str(raised.value)
    there.rmdir()
    there.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n")
    assert nvidia_driver_version(there) == "550.54.15"  # the failure above was not cached
