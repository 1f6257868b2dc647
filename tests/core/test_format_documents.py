"""Format 9 documents: exact JSON round trips and strict parsing, each failure its own typed error.

The strict-parsing tests mutate the *real* documents of a SmolLM2 capture field by field (every key of
every object kind that occurs in them), so a field added to a dataclass without strict parsing, or
parsed loosely, is caught without this file having to list it.
"""

from __future__ import annotations

import copy
import json
import string
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from core_support import Captured
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from coldsnap_core.artifact.overlay import OverlayDescriptor
from coldsnap_core.errors import (
    ManifestError,
    ManifestParseError,
    ManifestSchemaError,
    ManifestValueError,
    UnsupportedFormatVersionError,
)
from coldsnap_core.format._strict import MAX_OFFSET_BYTES
from coldsnap_core.format.allocation import (
    DTYPE_ITEMSIZE_BYTES,
    Allocation,
    AllocationMap,
    TensorPlacement,
    canonical_layout_json,
)
from coldsnap_core.format.descriptor import ArtifactDescriptor, CapsuleFile, WorkerEntry
from coldsnap_core.format.extents import ExtentProvenance, ModelExtent, ResidualExtent
from coldsnap_core.format.manifest import (
    CheckpointFile,
    ModelIdentity,
    NativeManifest,
    PackRef,
    RecoveryManifest,
    ResidualRef,
    WorkerIdentity,
)
from coldsnap_core.format.target import TargetIdentity

NULLABLE = {"address", "revision", "config_sha256", "fingerprint_sha256"}
"""Fields whose JSON value may be null."""

# --- hypothesis strategies for every document kind --------------------------------------------------

sha256s = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
offsets = st.integers(0, 1 << 62)  # any two add up to at most MAX_OFFSET_BYTES
sizes = st.integers(1, 1 << 62)
names = st.text(min_size=1, max_size=40)  # any Unicode scalar value, escapes included
tags = st.text(alphabet=string.ascii_letters + string.digits + "_.-", min_size=1, max_size=12)
file_names = tags.filter(lambda s: s not in (".", ".."))
roles = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)


@st.composite
def tensor_placements(draw: st.DrawFn) -> TensorPlacement:
    rank = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(0, 1000), min_size=rank, max_size=rank)))
    stride = tuple(draw(st.lists(st.integers(0, 1 << 20), min_size=rank, max_size=rank)))
    return TensorPlacement(draw(names), draw(st.sampled_from(sorted(DTYPE_ITEMSIZE_BYTES))), shape, stride, draw(offsets))


@st.composite
def allocation_maps(draw: st.DrawFn, *, addresses: bool | None = None) -> AllocationMap:
    """``addresses``: every allocation has one (native capture point), none has (portable), or either
    (``None``: the recovery manifest, which names no capture point)."""
    allocations = []
    for index in range(draw(st.integers(0, 4))):
        tensors = tuple(draw(st.lists(tensor_placements(), max_size=4)))
        needed = max((t.offset_bytes + t.span_bytes for t in tensors), default=0)
        size = needed + draw(st.integers(0, 1 << 20))
        integer = st.integers(0, MAX_OFFSET_BYTES)
        address = draw({True: integer, False: st.none(), None: st.none() | integer}[addresses])
        allocations.append(Allocation(index, size, draw(tags), address, tensors))
    return AllocationMap(tuple(allocations))


@st.composite
def workers(draw: st.DrawFn) -> WorkerIdentity:
    world = draw(st.integers(1, 64))
    tp = draw(st.integers(1, 64))
    dp = draw(st.integers(1, 4))  # 1: no data parallel fields in the JSON
    return WorkerIdentity(
        draw(roles), draw(st.integers(0, world - 1)), world, draw(st.integers(0, tp - 1)), tp, draw(st.integers(0, dp - 1)), dp
    )


provenances = st.builds(ExtentProvenance, names, names, offsets, offsets, offsets, offsets, st.booleans())


def _extents(kind: type, *more: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Extents of ``kind`` whose every ``start + size_bytes`` fits a signed 64-bit offset (§4: the parser
    refuses the others, and so does building one; the round trip is for valid documents, the overflow rule has
    its own tests)."""
    fields = st.tuples(st.integers(0, 1 << 20), offsets, sizes, offsets, *more)
    return fields.filter(lambda f: max(f[1], f[3]) + f[2] <= MAX_OFFSET_BYTES).map(lambda f: kind(*f))


model_extents = _extents(ModelExtent, sha256s, provenances)
residual_extents = _extents(ResidualExtent)
pack_refs = st.builds(PackRef.for_digest, sha256s, offsets) | st.builds(PackRef, name=names, size_bytes=offsets, sha256=sha256s)
residual_refs = st.builds(ResidualRef, name=file_names, size_bytes=offsets, sha256=sha256s)
name_components = st.text(
    st.characters(exclude_categories=("Cs",), exclude_characters="/\\\x00"), min_size=1, max_size=12
).filter(lambda s: s not in (".", ".."))
checkpoint_names = st.lists(name_components, min_size=1, max_size=3).map("/".join)
checkpoint_files = st.builds(CheckpointFile, checkpoint_names, offsets, sha256s, st.none() | sha256s)
model_identities = st.builds(
    ModelIdentity,
    names,
    st.none() | names,
    st.lists(checkpoint_files, min_size=1, max_size=3, unique_by=lambda c: c.name).map(
        lambda files: tuple(sorted(files, key=lambda c: c.name))
    ),
    st.none() | sha256s,
)


@st.composite
def native_manifests(draw: st.DrawFn) -> NativeManifest:
    capture_point = draw(st.sampled_from(["portable", "native"]))
    return NativeManifest(
        capture_point,
        draw(workers()),
        draw(sha256s),
        draw(pack_refs),
        draw(residual_refs),
        draw(allocation_maps(addresses=capture_point == "native")),
        tuple(draw(st.lists(model_extents, max_size=4))),
        tuple(draw(st.lists(residual_extents, max_size=4))),
    )


recovery_manifests = st.builds(
    RecoveryManifest,
    workers(),
    sha256s,
    model_identities,
    residual_refs,
    allocation_maps(),
    st.lists(residual_extents, max_size=4).map(tuple),
)


@st.composite
def capsule_files(draw: st.DrawFn) -> tuple[CapsuleFile, ...]:
    blob = draw(file_names.filter(lambda n: n not in ("native-manifest.json", "recovery-manifest.json", "target.json")))
    names = ["native-manifest.json", "recovery-manifest.json", "target.json", blob]
    return tuple(sorted((CapsuleFile(n, draw(offsets), draw(sha256s)) for n in names), key=lambda p: p.name))


@st.composite
def descriptors(draw: st.DrawFn) -> ArtifactDescriptor:
    entries = {}
    world = draw(st.integers(1, 64))  # one artifact holds one world (world size, data parallel size)
    dp = draw(st.integers(1, 3))
    for worker in draw(st.lists(workers(), min_size=1, max_size=4)):  # an artifact lists at least one worker
        worker = replace(
            worker,
            rank=worker.rank % world,
            world_size=world,
            data_parallel_rank=worker.data_parallel_rank % dp,
            data_parallel_size=dp,
        )
        entries[worker.sort_key] = WorkerEntry(worker, f"workers/{worker.capsule_name}", draw(pack_refs), draw(capsule_files()))
    return ArtifactDescriptor(draw(model_identities), tuple(sorted(entries.values(), key=lambda e: e.worker.sort_key)))


optional_names = st.none() | names
targets = st.builds(
    TargetIdentity,
    engine=roles,
    engine_version=optional_names,
    coldsnap_version=names,
    torch_version=names,
    torch_cuda_version=optional_names,
    device_type=roles,
    accelerator_model=optional_names,
    accelerator_count=st.integers(0, 1 << 20),
    nvidia_driver_version=optional_names,
    host=names,
)


@st.composite
def overlay_descriptors(draw: st.DrawFn) -> OverlayDescriptor:
    kind = draw(st.sampled_from(["overlay", "qualified"]))
    files = tuple(
        sorted(
            (
                CapsuleFile(n, draw(offsets), draw(sha256s))
                for n in ("native-manifest.json", "recovery-manifest.json", "target.json", "weights.blob")
            ),
            key=lambda p: p.name,
        )
    )
    return OverlayDescriptor(
        kind,
        draw(names),
        draw(sha256s),
        draw(workers()),
        draw(pack_refs),
        draw(targets),
        files if kind == "overlay" else (),
        draw(names),
    )


ROUND_TRIPS: list[tuple[str, st.SearchStrategy[Any], Callable[[bytes], Any]]] = [
    ("target identity", targets, TargetIdentity.loads),
    ("overlay descriptor", overlay_descriptors(), OverlayDescriptor.loads),
    ("native manifest", native_manifests(), NativeManifest.loads),
    ("recovery manifest", recovery_manifests, RecoveryManifest.loads),
    ("artifact descriptor", descriptors(), ArtifactDescriptor.loads),
]


@pytest.mark.parametrize(("kind", "strategy", "loads"), ROUND_TRIPS, ids=[r[0] for r in ROUND_TRIPS])
def test_every_document_kind_round_trips_through_json_exactly(kind: str, strategy: st.SearchStrategy[Any], loads) -> None:
    """Catches a field that ``dumps`` writes but ``loads`` reads differently (or not at all),
    a lossy type (tuple vs list, None vs missing, Unicode escapes), and non-canonical serialization:
    ``loads(dumps(x)) == x`` and ``dumps(loads(dumps(x))) == dumps(x)`` byte for byte, with sorted keys,
    two-space indent and a final newline. Every nested kind (allocation, tensor placement, model and
    residual extents, provenance, worker identity, pack and residual references, model identity,
    checkpoint file, worker entry) is inside one of the three documents."""

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(strategy)
    def check(document: Any) -> None:
        text = document.dumps()
        parsed = loads(text)
        assert parsed == document
        assert parsed.dumps() == text
        assert text == (json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()

    check()


# --- strict parsing, mutating the real documents of a capture -----------------------------------------


def _documents(captured: Captured) -> dict[str, tuple[dict, Callable[..., Any]]]:
    return {
        "native": (json.loads(captured.manifest_path.read_text()), NativeManifest.loads),
        "recovery": (json.loads(captured.recovery_path.read_text()), RecoveryManifest.loads),
        "descriptor": (json.loads((captured.artifact_dir / "artifact.json").read_text()), ArtifactDescriptor.loads),
    }


def _field_paths(node: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every key path of ``node`` (for lists, the first element only)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield (*path, key)
            yield from _field_paths(value, (*path, key))
    elif isinstance(node, list) and node:
        yield (*path, 0)
        yield from _field_paths(node[0], (*path, 0))


def _dotted(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _parent(doc: dict, path: tuple) -> Any:
    node = doc
    for part in path[:-1]:
        node = node[part]
    return node


def _parse_error(loads: Callable[..., Any], doc: dict) -> ManifestError:
    with pytest.raises(ManifestError) as info:
        loads(json.dumps(doc), file="/capsule/doc.json")
    assert "/capsule/doc.json" in str(info.value), "the message names the file"
    return info.value


@pytest.fixture(scope="module")
def documents(captured_2layer: Captured) -> dict[str, tuple[dict, Callable[..., Any]]]:
    return _documents(captured_2layer)


@pytest.mark.parametrize("kind", ["native", "recovery", "descriptor"])
def test_real_documents_parse_unchanged(documents, kind: str) -> None:
    """Catches a writer/reader disagreement on real data (the mutation tests below start from these)."""
    doc, loads = documents[kind]
    assert loads(json.dumps(doc)).to_json() == doc


@pytest.mark.parametrize("kind", ["native", "recovery", "descriptor"])
def test_missing_field_anywhere_is_a_schema_error_naming_its_path(documents, kind: str) -> None:
    """Catches a field that became optional by accident (``dict.get`` with a default): deleting any key
    of any object raises ManifestSchemaError naming the key's JSON path."""
    doc, loads = documents[kind]
    paths = [p for p in _field_paths(doc) if isinstance(p[-1], str)]
    assert len(paths) > 20
    for path in paths:
        mutated = copy.deepcopy(doc)
        del _parent(mutated, path)[path[-1]]
        error = _parse_error(loads, mutated)
        assert type(error) is ManifestSchemaError, path
        assert "missing field" in error.detail and _dotted(path) in error.detail, (path, error.detail)


@pytest.mark.parametrize("kind", ["native", "recovery", "descriptor"])
def test_unknown_field_in_any_object_is_a_schema_error(documents, kind: str) -> None:
    """Catches a reader that ignores keys it does not know (a newer writer's field silently dropped):
    adding a key to any object raises ManifestSchemaError naming it."""
    doc, loads = documents[kind]
    objects = [()] + [p for p in _field_paths(doc) if isinstance(_parent(doc, (*p, None)), dict)]
    assert len(objects) > 5
    for path in objects:
        mutated = copy.deepcopy(doc)
        _parent(mutated, (*path, None))["surprise_bytes"] = 1
        error = _parse_error(loads, mutated)
        assert type(error) is ManifestSchemaError and "unknown field" in error.detail, path
        assert _dotted((*path, "surprise_bytes")) in error.detail, (path, error.detail)


def _wrong_types(value: Any, key: Any) -> list[Any]:
    if isinstance(value, bool):
        return [1, "true", None, []]
    if isinstance(value, int):
        return [True, False, "7", 7.0, [7], {}] + ([] if key in NULLABLE else [None])
    if isinstance(value, str):
        return [7, True, ["x"], {}] + ([] if key in NULLABLE else [None])
    if isinstance(value, list):
        return ["x", 7, {}, None]
    if isinstance(value, dict):
        return ["x", 7, [], None]
    assert value is None and key in NULLABLE, key
    return [True, 7.5, "x", [], {}] if key == "address" else [7, True, [], {}]


@pytest.mark.parametrize("kind", ["native", "recovery", "descriptor"])
def test_mistyped_field_anywhere_is_a_schema_error(documents, kind: str) -> None:
    """Catches loose typing: a string, float, list, object or null where another JSON type belongs, and
    in particular ``true``/``false`` where an integer belongs (``bool`` is an ``int`` in Python), each
    raise ManifestSchemaError naming the field."""
    doc, loads = documents[kind]
    count = 0
    for path in _field_paths(doc):
        value = _parent(doc, path)[path[-1]]
        for wrong in _wrong_types(value, path[-1]):
            mutated = copy.deepcopy(doc)
            _parent(mutated, path)[path[-1]] = wrong
            error = _parse_error(loads, mutated)
            assert type(error) is ManifestSchemaError, (path, wrong, error)
            if path[-1] not in ("format_version", "format"):
                assert _dotted(path) in error.detail, (path, wrong, error.detail)
            count += 1
    assert count > 100


def _int_paths(doc: dict) -> list[tuple]:
    return [p for p in _field_paths(doc) if type(_parent(doc, p)[p[-1]]) is int and p[-1] != "format_version"]


@pytest.mark.parametrize("kind", ["native", "recovery", "descriptor"])
def test_negative_integer_anywhere_is_a_value_error(documents, kind: str) -> None:
    """Catches a missing lower bound: -1 in any integer field (offsets, sizes, indices, ranks, shape
    elements, addresses) raises ManifestValueError naming the field."""
    doc, loads = documents[kind]
    for path in _int_paths(doc):
        mutated = copy.deepcopy(doc)
        _parent(mutated, path)[path[-1]] = -1
        error = _parse_error(loads, mutated)
        assert type(error) is ManifestValueError and _dotted(path) in error.detail, (path, error)


@pytest.mark.parametrize("kind", ["native", "recovery", "descriptor"])
def test_integer_overflowing_int64_anywhere_is_a_value_error(documents, kind: str) -> None:
    """Catches a missing upper bound: 2**63 (one past the largest ``off_t``) in any integer field raises
    ManifestValueError, so no offset wraps around in a C reader."""
    doc, loads = documents[kind]
    for path in _int_paths(doc):
        mutated = copy.deepcopy(doc)
        _parent(mutated, path)[path[-1]] = 1 << 63
        error = _parse_error(loads, mutated)
        assert type(error) is ManifestValueError and "overflows" in error.detail, (path, error)


@pytest.mark.parametrize(
    ("where", "field"),
    [
        ("model_extents", "offset_bytes"),
        ("model_extents", "pack_offset_bytes"),
        ("residual_extents", "offset_bytes"),
        ("residual_extents", "blob_offset_bytes"),
    ],
)
def test_offset_plus_size_overflowing_int64_is_a_value_error(documents, where: str, field: str) -> None:
    """Catches a range whose start fits in int64 but whose end does not (``offset + size`` wrapping in
    a C reader): offset 2**63 - 1 with size >= 1 raises ManifestValueError."""
    doc, loads = documents["native"]
    mutated = copy.deepcopy(doc)
    mutated[where][0][field] = MAX_OFFSET_BYTES
    error = _parse_error(loads, mutated)
    assert type(error) is ManifestValueError and "overflows a signed 64-bit offset" in error.detail
    assert f"{where}[0]" in error.detail


@pytest.mark.parametrize("version", [8, 10, 0, 9000, -1, 1 << 63])
@pytest.mark.parametrize("kind", ["native", "recovery", "descriptor"])
def test_unknown_format_version_is_its_own_error(documents, kind: str, version: int) -> None:
    """Catches a reader that accepts a future (or past) layout: any format_version but 9 raises
    UnsupportedFormatVersionError, before any other field is looked at."""
    doc, loads = documents[kind]
    mutated = copy.deepcopy(doc)
    mutated["format_version"] = version
    mutated["future_field_bytes"] = 1  # a newer version may add fields: the version error wins
    error = _parse_error(loads, mutated)
    assert type(error) is UnsupportedFormatVersionError and str(version) in error.detail
    assert error.rule == "format-version" and error.exit_code == 2


@pytest.mark.parametrize(
    ("kind", "edit", "expected", "words"),
    [
        ("native", lambda d: d.update(format="coldsnap.recovery-manifest"), ManifestSchemaError, "document kind"),
        ("recovery", lambda d: d.update(format="coldsnap.native-manifest"), ManifestSchemaError, "document kind"),
        ("native", lambda d: d.update(capture_point="sideways"), ManifestValueError, "capture_point"),
        ("native", lambda d: d.update(layout_fingerprint="A" * 64), ManifestValueError, "layout_fingerprint"),
        ("native", lambda d: d["pack"].update(sha256="0" * 63), ManifestValueError, "pack.sha256"),
        ("native", lambda d: d["residual"].update(file="../weights.blob"), ManifestValueError, "residual.file"),
        ("native", lambda d: d["residual"].update(file=".."), ManifestValueError, "residual.file"),
        ("native", lambda d: d["worker"].update(role="Worker"), ManifestValueError, "worker.role"),
        ("native", lambda d: d["worker"].update(rank=1), ManifestValueError, "out of range"),
        ("native", lambda d: d["worker"].update(tensor_parallel_rank=1), ManifestValueError, "out of range"),
        ("native", lambda d: d["worker"].update(world_size=0), ManifestValueError, "worker.world_size"),
        ("native", lambda d: d["model_extents"][0].update(size_bytes=0), ManifestValueError, "model_extents[0].size_bytes"),
        ("native", lambda d: d["residual_extents"][0].update(size_bytes=0), ManifestValueError, "size_bytes"),
        ("native", lambda d: d["allocations"][1].update(index=0), ManifestValueError, "indices must be 0, 1, 2"),
        ("native", lambda d: d["allocations"][0].update(tag="a b"), ManifestValueError, "allocations[0].tag"),
        ("native", lambda d: d["allocations"][0]["tensors"][0].update(dtype="bfloat17"), ManifestValueError, "unknown dtype"),
        ("native", lambda d: d["allocations"][0]["tensors"][0]["stride"].pop(), ManifestValueError, "differ in rank"),
        ("native", lambda d: d["allocations"][0].update(size_bytes=100), ManifestValueError, "beyond the allocation"),
        ("native", lambda d: d["model_extents"][0]["provenance"].update(tensor_name=""), ManifestValueError, "must not be empty"),
        ("recovery", lambda d: d["model"].update(revision=""), ManifestValueError, "model.revision"),
        ("descriptor", lambda d: d["workers"][0].update(capsule="workers/worker-1-of-1"), ManifestValueError, "capsule"),
        (
            "descriptor",
            lambda d: d["workers"].append(d["workers"][0]),
            ManifestValueError,
            "same (role, data parallel rank, rank)",
        ),
        # data parallel: both fields or neither, size 1 is spelled by omission, rank below size, capsule from both
        ("native", lambda d: d["worker"].update(data_parallel_size=1, data_parallel_rank=0), ManifestValueError, "minimum 2"),
        ("native", lambda d: d["worker"].update(data_parallel_size=2, data_parallel_rank=2), ManifestValueError, "out of range"),
        ("native", lambda d: d["worker"].update(data_parallel_size=2), ManifestSchemaError, "worker.data_parallel_rank"),
        ("native", lambda d: d["worker"].update(data_parallel_rank=0), ManifestSchemaError, "worker.data_parallel_rank"),
        (
            "descriptor",
            lambda d: d["workers"][0].update(capsule="workers/worker-0-of-1-dp-0-of-2"),
            ManifestValueError,
            "not the worker's capsule folder",
        ),
        (
            "descriptor",
            lambda d: d["workers"][0]["worker"].update(data_parallel_rank=1, data_parallel_size=2),
            ManifestValueError,
            "not the worker's capsule folder",
        ),
    ],
)
def test_bad_values_are_value_errors(documents, kind: str, edit, expected: type, words: str) -> None:
    """Catches each value rule of the documents being dropped: digests are 64 lowercase hex characters,
    names have their documented form (no path traversal in ``residual.file``), ranks are below their
    sizes, extents are non-empty, allocation indices are 0, 1, 2, ..., tensors lie inside their
    allocation, dtypes are known, capsule folders are derived from the worker."""
    doc, loads = documents[kind]
    mutated = copy.deepcopy(doc)
    edit(mutated)
    error = _parse_error(loads, mutated)
    assert type(error) is expected and words in error.detail, error


def test_data_parallel_fields_are_written_for_every_replica_and_only_then() -> None:
    """Both data parallel fields are written with data parallel, replica 0's rank 0 included, and neither without it
    (docs/format.md §4.3). Fails if replica 0's rank is left out (msgspec leaves out a value that *is* its field's
    default object, which only a worker without data parallel holds), or if a worker without data parallel writes
    either field, however it was built (an artifact's bytes would change)."""
    plain = WorkerIdentity("worker", 0, 1, 0, 1)
    built_otherwise = (
        WorkerIdentity("worker", 0, 1, 0, 1, 0, 1),
        replace(WorkerIdentity("worker", 0, 1, 0, 1, 1, 2), data_parallel_rank=0, data_parallel_size=1),
    )
    for worker in (plain, *built_otherwise):
        assert worker == plain
        assert worker.to_json() == {
            "role": "worker",
            "rank": 0,
            "world_size": 1,
            "tensor_parallel_rank": 0,
            "tensor_parallel_size": 1,
        }
    replica = WorkerIdentity("worker", 0, 1, 0, 1, 0, 2).to_json()
    assert (replica["data_parallel_rank"], replica["data_parallel_size"]) == (0, 2)


@pytest.mark.parametrize(
    "build",
    [
        lambda: ModelIdentity("m", None, ()),
        lambda: CheckpointFile("../model.safetensors", 1, "0" * 64),
        lambda: WorkerIdentity("worker", 2, 2, 0, 1),
        lambda: TensorPlacement("w", "bfloat17", (1,), (1,), 0),
        lambda: ResidualExtent(0, MAX_OFFSET_BYTES, 1, 0),
        lambda: AllocationMap((Allocation(1, 0, "slab", None, ()),)),
    ],
    ids=["no-checkpoint-file", "name-leaves-the-folder", "rank-beyond-world", "unknown-dtype", "end-overflows", "index"],
)
def test_building_a_document_the_reader_refuses_is_a_manifest_value_error(build) -> None:
    """The rules across fields are the types' own (``__post_init__``), so a capture cannot build, and write, what
    every reader refuses. Fails if a rule runs only when a document is read, or raises an untyped error."""
    with pytest.raises(ManifestValueError):
        build()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"{", ManifestParseError),
        (b"\xff\xfe{}", ManifestParseError),
        (b'{"format_version": NaN}', ManifestParseError),
        (b"[" * 50_000 + b"]" * 50_000, ManifestParseError),
        (b"[]", ManifestSchemaError),
        (b'"coldsnap.native-manifest"', ManifestSchemaError),
        (
            b'{"format": "coldsnap.native-manifest", "format": "coldsnap.native-manifest", "format_version": 9}',
            ManifestSchemaError,
        ),
    ],
    ids=["truncated", "not-utf8", "nan", "deep", "list", "string", "duplicate-key"],
)
def test_not_a_json_object_is_refused(text: bytes, expected: type) -> None:
    """Catches a parser that accepts non-JSON (``NaN``), crashes on deep nesting (RecursionError), or
    silently keeps the last of two equal keys (an ambiguity two readers may resolve differently)."""
    with pytest.raises(expected) as info:
        NativeManifest.loads(text, file="m.json")
    assert info.value.exit_code == 2


def test_read_missing_document_is_a_missing_object(tmp_path) -> None:
    """Catches a FileNotFoundError escaping untyped (exit code 4 instead of 3)."""
    from coldsnap_core.errors import MissingObjectError

    with pytest.raises(MissingObjectError) as info:
        NativeManifest.read(tmp_path / "native-manifest.json")
    assert info.value.exit_code == 3 and "native-manifest.json" in str(info.value)


def _reference_bytes(document: Any) -> bytes:
    """What ``docs/format.md`` §4 says a document's bytes are."""
    return (json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


_PLAIN_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.lists(st.integers(), max_size=5)  # the all-int fast path (shapes, strides)
        | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.text(max_size=8), _PLAIN_JSON, max_size=6))
def test_dump_document_writes_exactly_the_bytes_json_dumps_writes(document: dict) -> None:
    """Catches the document writer drifting from the documented bytes (``json.dumps`` with indent 2,
    sorted keys, non-ASCII as is, final newline): a separator, an indent, the sort, the escaping of a
    control or non-ASCII character, an empty list or object, a nested all-integer list, booleans kept
    apart from integers."""
    from coldsnap_core.format._strict import dump_document

    assert dump_document(document) == _reference_bytes(document)


def test_real_documents_are_written_as_the_documented_bytes(captured_2layer: Captured) -> None:
    """Catches a capture writing a manifest, ``target.json`` or ``artifact.json`` whose bytes differ
    from the documented serialization of its own content (a real SmolLM2 2-layer capture)."""
    paths = [*sorted(captured_2layer.capsule_dir.glob("*.json")), captured_2layer.artifact_dir / "artifact.json"]
    assert len(paths) >= 4
    for path in paths:
        assert path.read_bytes() == _reference_bytes(json.loads(path.read_text())), path.name


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(allocation_maps())
def test_canonical_layout_text_is_the_documented_json(amap: AllocationMap) -> None:
    """The layout fingerprint hashes text written without ``json.dumps`` (format.md 4.4). Fails if that text
    differs in any byte from ``json.dumps(..., sort_keys=True, separators=(",", ":"))`` for any names (escapes,
    non-ASCII, surrogate pairs), tags, shapes or offsets: every capsule's fingerprint would change."""
    reference = json.dumps(
        [
            {"index": a.index, "size_bytes": a.size_bytes, "tag": a.tag, "tensors": [t.to_json() for t in a.tensors]}
            for a in amap.allocations
        ],
        sort_keys=True,
        separators=(",", ":"),
    )
    assert canonical_layout_json(amap.allocations) == reference
