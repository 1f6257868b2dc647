"""Parsed-capsule records (``docs/format.md`` §10.4): a restart of a restore takes a pinned capsule's parsed
documents from ``<state-root>/parsed-capsules/`` instead of parsing its manifests again, and a record is only
ever a stand-in for the strict parse of the same pinned bytes by the same parser."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import pickletools
import shutil
import stat
from pathlib import Path

import pytest
import torch

from coldsnap_core.artifact import parsed_capsules
from coldsnap_core.artifact.capsules import read_capsule
from coldsnap_core.artifact.parsed_capsules import (
    HEADER_BYTES,
    PARSED_CAPSULES_DIRNAME,
    RECORD_MAGIC,
    ParsedCapsules,
    decode,
    encode,
    sources_digest,
)
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.copy.torch_allocations import enumerate_allocations
from coldsnap_core.errors import CapsulePinMismatchError, TargetMismatchError
from coldsnap_core.format._strict import dump_document
from coldsnap_core.format.manifest import NATIVE_MANIFEST_FILENAME, NativeManifest
from coldsnap_core.format.target import TARGET_FILENAME
from tests.restore.test_worker_restore import RANK0, TinyModel, capture, checkpoint, restorer  # noqa: F401

_EXECUTED: list[str] = []


def _executed_if_unpickled() -> None:  # a global a forged record names: refusing it must run nothing
    _EXECUTED.append("called")


@pytest.fixture
def captured(tmp_path: Path, checkpoint: Path) -> TinyModel:  # noqa: F811
    model = TinyModel()
    capture(model, checkpoint, tmp_path / "artifact", tmp_path / "state")
    return model


def _restore(tmp_path: Path, checkpoint: Path) -> TinyModel:  # noqa: F811
    fresh = TinyModel()
    with torch.no_grad():
        fresh.rope.zero_()
    restorer(checkpoint, tmp_path / "artifact", tmp_path / "state").run(enumerate_allocations(fresh), HostCopyBackend())
    return fresh


def _records(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "state" / PARSED_CAPSULES_DIRNAME).glob("*.record"))


class _ParseCounter:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = NativeManifest.from_fields.__func__  # type: ignore[attr-defined]

        def counted(cls, f):
            self.calls += 1
            return original(cls, f)

        monkeypatch.setattr(NativeManifest, "from_fields", classmethod(counted))


def test_a_restore_takes_the_record_instead_of_parsing(tmp_path: Path, checkpoint: Path, captured, monkeypatch) -> None:  # noqa: F811
    """The capture reads its capsule back as a restore does, which writes one record (mode 0444); every
    restore after it restores the same bytes without parsing a manifest. With the record removed, the next
    restore parses once and writes it again. Fails if the record is not written, not read, or restores other
    bytes."""
    (record,) = _records(tmp_path)
    assert os.stat(record).st_mode & 0o777 == 0o444
    parses = _ParseCounter(monkeypatch)
    for _ in range(2):
        assert _restore(tmp_path, checkpoint).snapshot() == captured.snapshot()
    assert parses.calls == 0
    good = record.read_bytes()
    record.unlink()
    assert _restore(tmp_path, checkpoint).snapshot() == captured.snapshot()
    assert parses.calls == 1
    assert record.read_bytes() == good
    assert _restore(tmp_path, checkpoint).snapshot() == captured.snapshot()
    assert parses.calls == 1


def test_the_record_holds_exactly_the_strict_parse(tmp_path: Path, checkpoint: Path, captured) -> None:  # noqa: F811
    """The record decodes to objects equal to a strict read of the capsule (every field of every allocation,
    tensor and extent), shares the allocation map between the two manifests as the strict read does, and
    encodes again to the same bytes, each object as its constructor call. Fails on a dropped, reordered or
    re-typed field in the encoding, or on pickle's default encoding of the objects."""
    _restore(tmp_path, checkpoint)
    (record,) = _records(tmp_path)
    data = record.read_bytes()
    key = record.name.removesuffix(".record")
    native, recovery, target = decode(data, key)
    strict = read_capsule(tmp_path / "artifact" / "workers" / RANK0.capsule_name)
    assert (native, recovery, target) == (strict.native, strict.recovery, strict.target)
    assert target is not None
    assert recovery.allocations is native.allocations
    assert encode((native, recovery, target), key) == data
    # docs/format.md §10.4: each object is a call of its class with its fields (REDUCE), not an empty object
    # filled by __setstate__ (NEWOBJ + BUILD, pickle's default for slotted dataclasses, twice as slow to load).
    opcodes = {op.name for op, _, _ in pickletools.genops(data[HEADER_BYTES:])}
    assert "REDUCE" in opcodes and not opcodes & {"BUILD", "NEWOBJ", "NEWOBJ_EX"}
    assert data.startswith(RECORD_MAGIC + key.encode() + b"\n")
    assert data[len(RECORD_MAGIC) + 65 : HEADER_BYTES - 1].decode() == hashlib.sha256(data[HEADER_BYTES:]).hexdigest()


def test_an_edited_manifest_is_refused_by_its_pin_although_a_record_exists(tmp_path: Path, checkpoint: Path, captured) -> None:  # noqa: F811
    """A record never stands in for the files: with a record of the capsule present, a byte changed in the
    native manifest is still refused by its pin in artifact.json. Fails if the record is looked up before
    (or instead of) the pin checks."""
    _restore(tmp_path, checkpoint)
    path = tmp_path / "artifact" / "workers" / RANK0.capsule_name / NATIVE_MANIFEST_FILENAME
    data = bytearray(path.read_bytes())
    data[data.index(b'"size_bytes": ') + 14] ^= 0x01  # a digit of the first size: same length, other bytes
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    with pytest.raises(CapsulePinMismatchError, match=r"native-manifest\.json is .* bytes with SHA-256"):
        restorer(checkpoint, tmp_path / "artifact", tmp_path / "state").read()


def _forge(key: str, body: bytes) -> bytes:
    return RECORD_MAGIC + key.encode() + b"\n" + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


class _Calls:
    """A pickle that calls :func:`_executed_if_unpickled` when loaded by an unrestricted unpickler."""

    def __reduce__(self):
        return (_executed_if_unpickled, ())


@pytest.mark.parametrize(
    "damage",
    ["flipped-body-byte", "truncated", "other-magic", "group-writable", "symlink", "fifo", "foreign-global", "wrong-types"],
)
def test_a_record_that_may_not_be_used_is_ignored_and_rewritten(
    tmp_path: Path,
    checkpoint: Path,  # noqa: F811
    captured,
    monkeypatch,
    caplog,
    damage: str,
) -> None:
    """Each way a record can be unusable (a flipped byte under its digest, a torn write, another kind or
    version, a mode another user could have written, a symbolic link, a FIFO, a class outside the allow-list,
    other types) makes the restore parse strictly (logged at INFO), restore the right bytes, run nothing the
    forged record names, and write a good record in its place (a symbolic link or a FIFO is left as it is,
    never written through or waited on). Fails if any of them is used."""
    _restore(tmp_path, checkpoint)
    (record,) = _records(tmp_path)
    key = record.name.removesuffix(".record")
    good = record.read_bytes()
    os.chmod(record, 0o644)
    if damage == "flipped-body-byte":
        data = bytearray(good)
        data[-10] ^= 0x01
        record.write_bytes(bytes(data))
    elif damage == "truncated":
        record.write_bytes(good[: len(good) // 2])
    elif damage == "other-magic":
        record.write_bytes(good.replace(b"parsed-capsule 1", b"parsed-capsule 2", 1))
    elif damage == "group-writable":
        os.chmod(record, 0o664)
    elif damage == "fifo":  # opened non-blocking and checked with fstat: refused, never waited on
        record.unlink()
        os.mkfifo(record)
    elif damage == "symlink":
        elsewhere = tmp_path / "elsewhere.record"
        shutil.copyfile(record, elsewhere)
        record.unlink()
        record.symlink_to(elsewhere)
    elif damage == "foreign-global":
        record.write_bytes(_forge(key, pickle.dumps(_Calls(), protocol=5)))
    elif damage == "wrong-types":
        native, recovery, _ = decode(good, key)
        record.write_bytes(_forge(key, pickle.dumps((native, recovery), protocol=5)))
    parses = _ParseCounter(monkeypatch)
    with caplog.at_level(logging.INFO, logger=parsed_capsules.__name__):
        assert _restore(tmp_path, checkpoint).snapshot() == captured.snapshot()
    assert parses.calls == 1
    assert _EXECUTED == []
    assert "not using the parsed-capsule record" in caplog.text
    if damage == "symlink":  # refused, never written through (docs/format.md §10: no symbolic links)
        assert record.is_symlink() and (tmp_path / "elsewhere.record").read_bytes() == good
    elif damage == "fifo":  # refused and left in place (docs/format.md §10: only regular files)
        assert stat.S_ISFIFO(os.lstat(record).st_mode)
    else:
        assert record.read_bytes() == good


def test_another_parser_reads_another_record(tmp_path: Path, checkpoint: Path, captured, monkeypatch) -> None:  # noqa: F811
    """A record is keyed by the parser's own source digest: after an upgrade (another digest) the first
    restore parses strictly and writes a second record. Fails if the key ignores the parser."""
    monkeypatch.setattr(parsed_capsules, "parser_digest", lambda: "0" * 64)
    parses = _ParseCounter(monkeypatch)
    _restore(tmp_path, checkpoint)
    assert parses.calls == 1
    assert len(_records(tmp_path)) == 2


def test_the_parser_digest_covers_every_parsing_source(tmp_path: Path) -> None:
    """One byte changed in any module of ``format/`` or in the capsule reader changes the parser digest; a
    copy without the format sources has none (records are then not used). Fails if a source is left out."""
    package = Path(parsed_capsules.__file__).parent.parent
    copy = tmp_path / "coldsnap_core"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    base = sources_digest(copy)
    assert base is not None and base == sources_digest(package)
    for relative in ("format/allocation.py", "format/_strict.py", "artifact/capsules.py", "digests.py"):
        path = copy / relative
        original = path.read_bytes()
        path.write_bytes(original + b"\n")
        assert sources_digest(copy) != base, relative
        path.write_bytes(original)
    shutil.rmtree(copy / "format")
    assert sources_digest(copy) is None


def test_the_key_is_fixed_by_the_pins_and_the_parser(monkeypatch) -> None:
    """Golden key for fixed pins and a fixed parser digest; any pin changes it. Fails if the key's text
    changes (old records would then be orphaned, not misread, but the spec in docs/format.md §10.4 says what
    it is)."""
    monkeypatch.setattr(parsed_capsules, "parser_digest", lambda: "ab" * 32)
    records = ParsedCapsules(Path("/nonexistent"))
    pins = ["11" * 32, "22" * 32, "33" * 32]
    expected = hashlib.sha256(("coldsnap.parsed-capsule\n" + "ab" * 32 + "\n" + "\n".join(pins)).encode()).hexdigest()
    assert records.key(pins) == expected
    assert records.key([*pins[:2], None]) != expected
    assert records.key(["11" * 32, "22" * 32, "34" * 32]) != expected


@pytest.mark.parametrize("obstacle", ["file", "symlink"])
def test_an_unusable_records_folder_never_stops_a_restore(
    tmp_path: Path,
    checkpoint: Path,  # noqa: F811
    captured,
    monkeypatch,
    obstacle: str,
) -> None:
    """``parsed-capsules`` is a regular file (nothing can be written) or a symbolic link to another folder
    (never followed): every restore parses strictly and succeeds, and nothing is written through the link.
    Fails if a record problem becomes a restore failure, or if the link is followed."""
    folder = tmp_path / "state" / PARSED_CAPSULES_DIRNAME
    shutil.rmtree(folder)  # the capture's read-back wrote a record there
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if obstacle == "file":
        folder.write_bytes(b"")
    else:
        folder.symlink_to(elsewhere)
    parses = _ParseCounter(monkeypatch)
    for _ in range(2):
        assert _restore(tmp_path, checkpoint).snapshot() == captured.snapshot()
    assert parses.calls == 2
    assert list(elsewhere.iterdir()) == []


def test_gc_removes_records_older_than_its_threshold(tmp_path: Path, checkpoint: Path, captured, capsys) -> None:  # noqa: F811
    """``coldsnap cache gc --older-than 3600`` removes a record last written two hours ago (and a dead writer's
    temporary beside it), keeps one written now, and ``--dry-run`` only lists; the next restore writes the
    removed record again. Fails if gc ignores the folder, or removes records by another clock."""
    from coldsnap_core.cli.main import main

    _restore(tmp_path, checkpoint)
    (record,) = _records(tmp_path)
    folder = record.parent
    fresh = folder / ("f" * 64 + ".record")
    fresh.write_bytes(b"x")
    temporary = folder / f".{record.name}.0123456789abcdef.partial"
    temporary.write_bytes(b"torn")
    two_hours_ago = record.stat().st_mtime - 7200
    for path in (record, temporary):
        os.utime(path, (two_hours_ago, two_hours_ago))
    state = ["--state-root", str(tmp_path / "state")]
    assert main(["cache", "gc", "--dry-run", *state]) == 0
    assert f"would remove parsed-capsule record {record}" in capsys.readouterr().out
    assert record.exists() and temporary.exists()
    assert main(["cache", "gc", *state]) == 0
    out = capsys.readouterr()
    assert f"removed parsed-capsule record {record}" in out.out and "2 parsed-capsule record(s)" in out.err
    assert sorted(folder.iterdir()) == [fresh]
    _restore(tmp_path, checkpoint)
    assert record.exists()


def test_a_capture_whose_capsule_does_not_read_back_says_so(tmp_path: Path, checkpoint: Path, monkeypatch, caplog) -> None:  # noqa: F811
    """The capture reads its capsule back strictly before it returns: a capsule the parser refuses (here any
    native manifest) is one WARNING naming the worker and the parser's error, and leaves no parsed-capsule
    record. Fails if the read-back is dropped (a capture would then only be refused at the first restore)."""

    def refuse(cls, f):
        raise f.error("refused by the test")

    monkeypatch.setattr(NativeManifest, "from_fields", classmethod(refuse))
    with caplog.at_level(logging.WARNING):
        capture(TinyModel(), checkpoint, tmp_path / "artifact", tmp_path / "state")
    assert f"{RANK0.capsule_name}: the capsule just written does not read back" in caplog.text
    assert "refused by the test" in caplog.text
    assert _records(tmp_path) == []


def _repin(artifact: Path, name: str, data: bytes) -> None:
    """Pin ``data`` for every capsule file called ``name`` in ``artifact.json`` (an operator's re-signing)."""
    path = artifact / "artifact.json"
    doc = json.loads(path.read_text())
    for entry in doc["workers"]:
        for pin in entry["capsule_files"]:
            if pin["name"] == name:
                pin.update(size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    os.chmod(path, 0o644)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def test_a_record_stands_in_only_for_the_key_it_was_written_for(
    tmp_path: Path,
    checkpoint: Path,  # noqa: F811
    captured,
    caplog,
) -> None:
    """A record names its key: artifact B is artifact A with another ``torch_version`` in ``target.json``
    (re-pinned), so its restore is refused by its target; with A's record copied under B's key (a rename in
    the records folder, by anyone who can write there) B is still judged by its own ``target.json``, and the
    copy is refused at INFO and replaced. Fails if a record is used under a key it was not written for: B's
    restore then takes A's target identity and replays a residual captured on another torch."""
    (record_a,) = _records(tmp_path)
    artifact_b = tmp_path / "artifact-b"
    shutil.copytree(tmp_path / "artifact", artifact_b)
    target_path = artifact_b / "workers" / RANK0.capsule_name / TARGET_FILENAME
    document = json.loads(target_path.read_text())
    document["torch_version"] = "0.0.0+elsewhere"
    data = dump_document(document)
    os.chmod(target_path, 0o644)
    target_path.write_bytes(data)
    _repin(artifact_b, TARGET_FILENAME, data)

    def restore_b() -> None:
        fresh = TinyModel()
        restorer(checkpoint, artifact_b, tmp_path / "state").run(enumerate_allocations(fresh), HostCopyBackend())

    with pytest.raises(TargetMismatchError, match="torch_version"):
        restore_b()  # strictly parsed: refused by its target, and its record written
    (record_b,) = [r for r in _records(tmp_path) if r != record_a]
    os.chmod(record_b, 0o644)
    shutil.copyfile(record_a, record_b)
    os.chmod(record_b, 0o444)
    with (
        caplog.at_level(logging.INFO, logger=parsed_capsules.__name__),
        pytest.raises(TargetMismatchError, match="torch_version"),
    ):
        restore_b()
    assert f"not using the parsed-capsule record {record_b}" in caplog.text
    assert record_b.read_bytes() != record_a.read_bytes()


def test_a_record_used_or_written_is_one_debug_line_naming_it(tmp_path: Path, checkpoint: Path, captured, caplog) -> None:  # noqa: F811
    """With DEBUG on (``VLLM_LOGGING_LEVEL=DEBUG``), a restore that takes its documents from a record says so,
    naming the record, and one that parsed and wrote it names the record written: an operator can tell
    from the log which of the two a start did. Fails if either path is silent at DEBUG."""
    (record,) = _records(tmp_path)
    with caplog.at_level(logging.DEBUG, logger=parsed_capsules.__name__):
        _restore(tmp_path, checkpoint)
    assert f"coldsnap: parsed-capsule record {record} used" in caplog.text
    assert f"{record} written" not in caplog.text
    caplog.clear()
    record.unlink()
    with caplog.at_level(logging.DEBUG, logger=parsed_capsules.__name__):
        _restore(tmp_path, checkpoint)
    assert f"coldsnap: parsed-capsule record {record} written" in caplog.text
    assert f"{record} used" not in caplog.text


def test_gc_names_a_dead_writers_temporary_as_a_temporary(tmp_path: Path, checkpoint: Path, captured, capsys) -> None:  # noqa: F811
    """A writer killed between creating its temporary and renaming it leaves ``.<key>.record.<hex16>.partial``:
    ``coldsnap cache gc`` lists it as a parsed-capsule temporary, not as a record (which it never was), and the
    record beside it as a record. Fails if gc calls the temporary a record."""
    from coldsnap_core.cli.main import main

    (record,) = _records(tmp_path)
    temporary = record.parent / f".{record.name}.0123456789abcdef.partial"
    temporary.write_bytes(b"torn")
    assert main(["cache", "gc", "--older-than", "0", "--state-root", str(tmp_path / "state")]) == 0
    out = capsys.readouterr().out
    assert f"removed parsed-capsule temporary {temporary}" in out
    assert f"removed parsed-capsule record {record}\n" in out
    assert f"record {temporary}" not in out
