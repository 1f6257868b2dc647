"""Unit tests of the write observer on small torch modules and a real safetensors file (no engine).

Each test mimics one write pattern of vLLM's weight loaders (``default_weight_loader`` in
``vllm/model_executor/model_loader/weight_utils.py``; column/row-parallel ``narrow``,
``QKVParallelLinear`` and ``MergedColumnParallelLinear`` stacking in ``vllm/model_executor/layers/linear.py``;
``VocabParallelEmbedding`` padding in ``vllm/model_executor/layers/vocab_parallel_embedding.py``; tied embeddings) and
checks, byte for byte, which destination ranges end up as model bytes and with which provenance.
"""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _get_current_dispatch_mode_stack

from coldsnap_core.capture.checkpoint_sources import CheckpointSources
from coldsnap_core.capture.load_session import LoadSession, PreparedWeights
from coldsnap_core.capture.observer import WriteObserver, map_to_allocations
from coldsnap_core.copy.torch_allocations import enumerate_allocations
from coldsnap_core.errors import ObserverError
from coldsnap_core.format.safetensors_header import read_header
from tests.support.observer_support import (
    DeviceTensor,
    WrapperTensor,
    file_bytes,
    open_checkpoint,
    pattern,
    tensor_bytes,
    write_checkpoint,
)


def _param(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


def _ranges(module: torch.nn.Module, observer: WriteObserver):
    ranges, _ = map_to_allocations(observer.model_records(), enumerate_allocations(module))
    return ranges


def _check_against_file(module: torch.nn.Module, observer: WriteObserver, checkpoint: Path) -> None:
    """Every model range's destination bytes equal the file bytes its provenance names."""
    allocations = enumerate_allocations(module)
    for r in _ranges(module, observer):
        p = r.provenance
        expected = b"".join(
            file_bytes(checkpoint, p.source_offset_bytes + k * p.source_run_stride_bytes, p.source_run_bytes)
            for k in range(p.source_size_bytes // p.source_run_bytes)
        )
        storage = allocations.storages[r.allocation_index]
        actual = bytes(storage)[r.offset_bytes : r.offset_bytes + r.size_bytes]
        assert actual == expected, r


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path)


def test_plain_copy_is_one_extent_with_the_file_offset(checkpoint: Path) -> None:
    """``default_weight_loader``: one copy_, one extent whose provenance is the header's byte range.
    Fails if the source offset is taken from the mapping instead of the header, or the copy is split."""
    m = torch.nn.Module()
    m.w = _param(8, 8)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.w.data.copy_(t["o.weight"])
    (r,) = _ranges(m, observer)
    assert (r.allocation_index, r.offset_bytes, r.size_bytes) == (0, 0, 128)
    assert r.provenance.tensor_name == "o.weight" and r.provenance.checkpoint_file == "model.safetensors"
    assert r.provenance.source_run_bytes == r.provenance.source_run_stride_bytes == 128
    assert not r.provenance.dtype_converted
    _check_against_file(m, observer, checkpoint)


def test_row_parallel_narrow_on_dim_1_is_a_strided_source(checkpoint: Path) -> None:
    """``RowParallelLinear`` at tensor parallel rank 1 of 2: ``narrow(1, 8, 8)`` of a [8, 16] tensor
    gives one destination extent read as 8 runs of 16 bytes, 32 bytes apart, starting 16 bytes in.
    Fails if a non-contiguous source is classified as contiguous or dropped."""
    m = torch.nn.Module()
    m.w = _param(8, 8)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.w.data.copy_(t["down.weight"].narrow(1, 8, 8))
    (r,) = _ranges(m, observer)
    assert (r.offset_bytes, r.size_bytes) == (0, 128)
    assert (r.provenance.source_run_bytes, r.provenance.source_run_stride_bytes, r.provenance.source_size_bytes) == (16, 32, 128)
    assert r.provenance.source_offset_bytes == read_header(checkpoint)["down.weight"].offset_bytes + 16
    _check_against_file(m, observer, checkpoint)


def test_column_parallel_narrow_on_dim_0_is_contiguous(checkpoint: Path) -> None:
    """``ColumnParallelLinear`` rank 1 of 2: rows 4..7 of q are one contiguous run 64 bytes in."""
    m = torch.nn.Module()
    m.w = _param(4, 8)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.w.data.copy_(t["q.weight"].narrow(0, 4, 4))
    (r,) = _ranges(m, observer)
    assert r.provenance.source_run_bytes == r.provenance.source_run_stride_bytes == r.size_bytes == 64
    _check_against_file(m, observer, checkpoint)


def test_stacked_qkv_gets_one_extent_per_shard_copy(checkpoint: Path) -> None:
    """``QKVParallelLinear``: q at byte 0, k right after q, v right after k, one extent each.
    Fails if stacked shards are merged, misplaced or attributed to the wrong tensor."""
    m = torch.nn.Module()
    m.qkv = _param(16, 8)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.qkv.data.narrow(0, 0, 8).copy_(t["q.weight"])
        m.qkv.data.narrow(0, 8, 4).copy_(t["k.weight"])
        m.qkv.data.narrow(0, 12, 4).copy_(t["v.weight"])
    ranges = _ranges(m, observer)
    assert [(r.offset_bytes, r.size_bytes, r.provenance.tensor_name) for r in ranges] == [
        (0, 128, "q.weight"),
        (128, 64, "k.weight"),
        (192, 64, "v.weight"),
    ]
    assert observer.checkpoint_copies == 3
    _check_against_file(m, observer, checkpoint)


def test_strided_destination_gets_one_extent_per_row(checkpoint: Path) -> None:
    """A destination narrowed on dim 1 (column block of a wider parameter) is not contiguous: each
    row is its own extent. Fails if the gaps between rows are claimed as model bytes."""
    m = torch.nn.Module()
    m.w = _param(4, 16)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.w.data.narrow(1, 0, 8).copy_(t["k.weight"])
    ranges = _ranges(m, observer)
    assert [(r.offset_bytes, r.size_bytes) for r in ranges] == [(0, 16), (32, 16), (64, 16), (96, 16)]
    _check_against_file(m, observer, checkpoint)


def test_fill_after_copy_makes_those_bytes_residual(checkpoint: Path) -> None:
    """A ``fill_`` over part of a copied range splits it: the filled rows are residual, the rest keep
    their provenance (shifted source offsets). Fails if later writes are not seen."""
    m = torch.nn.Module()
    m.w = _param(8, 8)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.w.data.copy_(t["o.weight"])
        m.w.data[2:3].fill_(0)
        m.w.data[5:6].zero_()
    ranges = _ranges(m, observer)
    assert [(r.offset_bytes, r.size_bytes) for r in ranges] == [(0, 32), (48, 32), (96, 32)]
    _check_against_file(m, observer, checkpoint)


def test_fill_before_copy_does_not_matter(checkpoint: Path) -> None:
    """A write *before* the checkpoint copy is overwritten by it: the bytes are model bytes. Fails if
    the observer marks bytes residual that hold checkpoint bytes at capture time."""
    m = torch.nn.Module()
    m.w = _param(8, 8)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.w.data.fill_(1)
        m.w.data.copy_(t["o.weight"])
    assert [(r.offset_bytes, r.size_bytes) for r in _ranges(m, observer)] == [(0, 128)]


def test_second_copy_over_a_recorded_range_is_residual(checkpoint: Path) -> None:
    """Two checkpoint copies into the same bytes: the overlap is residual (a second write), the
    bytes only one copy wrote stay model bytes."""
    m = torch.nn.Module()
    m.w = _param(8, 8)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.w.data.narrow(0, 0, 4).copy_(t["k.weight"])
        m.w.data.narrow(0, 2, 4).copy_(t["v.weight"])
    assert [(r.offset_bytes, r.size_bytes, r.provenance.tensor_name) for r in _ranges(m, observer)] == [
        (0, 32, "k.weight"),
        (64, 32, "v.weight"),
    ]


def test_dtype_converting_copy_is_residual_when_opted_out(checkpoint: Path) -> None:
    """bf16 checkpoint -> fp32 parameter with ``converted_copies="residual"``: the destination bytes
    are not the file's bytes, so they are residual. Fails if the opt-out is ignored or a converting
    copy is recorded as a byte copy."""
    m = torch.nn.Module()
    m.w = _param(8, dtype=torch.float32)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources, converted_copies="residual") as observer:
        m.w.data.copy_(t["norm.weight"])
    assert _ranges(m, observer) == []


def test_dtype_converting_copy_is_a_model_extent_by_default(checkpoint: Path) -> None:
    """``converted_copies="model"`` (the default): one extent of 32 destination bytes (8 fp32) from 16 source bytes
    (8 bf16), marked ``dtype_converted``; a fill over one fp32 element cuts exactly that element
    and the matching 2 source bytes."""
    m = torch.nn.Module()
    m.w = _param(8, dtype=torch.float32)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.w.data.copy_(t["norm.weight"])
        m.w.data[3:4].fill_(0)
    ranges = _ranges(m, observer)
    assert [(r.offset_bytes, r.size_bytes, r.provenance.source_size_bytes) for r in ranges] == [(0, 12, 6), (16, 16, 8)]
    assert all(r.provenance.dtype_converted for r in ranges)
    base = read_header(checkpoint)["norm.weight"].offset_bytes
    assert [r.provenance.source_offset_bytes for r in ranges] == [base, base + 8]


def test_tied_weights_are_one_allocation_copied_once(checkpoint: Path) -> None:
    """``lm_head.weight`` tied to ``embed_tokens.weight``: one storage, listed as one allocation
    hosting both names; the single copy is one extent. Fails if aliases become two allocations
    (hydration would then write the bytes twice and the layout would differ from vLLM's)."""
    m = torch.nn.Module()
    m.embed = torch.nn.Module()
    m.lm_head = torch.nn.Module()
    m.embed.weight = _param(10, 8)
    m.lm_head.weight = m.embed.weight
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.embed.weight.data.copy_(t["embed.weight"])
    allocations = enumerate_allocations(m)
    assert len(allocations.allocation_map) == 1
    assert [p.name for p in allocations.allocation_map[0].tensors] == ["embed.weight", "lm_head.weight"]
    assert [(r.offset_bytes, r.size_bytes) for r in _ranges(m, observer)] == [(0, 160)]


def test_vocabulary_padding_is_residual(checkpoint: Path) -> None:
    """``VocabParallelEmbedding``: 10 checkpoint rows copied into a 16-row (padded) parameter, the
    padding rows filled with zeros: model bytes are exactly the 10 rows."""
    m = torch.nn.Module()
    m.embed = _param(16, 8)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.embed[:10].data.copy_(t["embed.weight"])
        m.embed[10:].data.fill_(0)
    assert [(r.offset_bytes, r.size_bytes) for r in _ranges(m, observer)] == [(0, 160)]
    assert enumerate_allocations(m).allocation_map[0].size_bytes == 256


def test_index_put_and_out_arguments_are_writes(checkpoint: Path) -> None:
    """``index_put_`` (``view[idx] = x``) and an ``out=`` argument are writes found from the operator
    schema (``Tensor(a!)``). The whole tensor an ``index_put_`` indexes becomes residual (which rows
    it touches depends on the index values), here rows 6-7; ``out=`` makes row 0 residual."""
    m = torch.nn.Module()
    m.w = _param(8, 8)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.w.data.copy_(t["o.weight"])
        m.w.data[6:8][torch.tensor([1])] = torch.ones(1, 8, dtype=torch.bfloat16)
        torch.add(t["q.weight"][0], 1, out=m.w.data[0])
    assert [(r.offset_bytes, r.size_bytes) for r in _ranges(m, observer)] == [(16, 80)]


def test_metadata_only_inplace_ops_are_not_writes(checkpoint: Path) -> None:
    """``t_()`` / ``unsqueeze_()`` change a view's metadata, not bytes (tag ``inplace_view``)."""
    m = torch.nn.Module()
    m.w = _param(8, 8)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.w.data.copy_(t["o.weight"])
        view = m.w.data.view(8, 8)
        view.t_()
        view.unsqueeze_(0)
    assert [(r.offset_bytes, r.size_bytes) for r in _ranges(m, observer)] == [(0, 128)]


def test_copy_from_a_modified_checkpoint_tensor_is_residual(checkpoint: Path) -> None:
    """A registered checkpoint tensor written in place (``mul_``) no longer holds the file's bytes:
    copies from it afterwards are residual. Fails if writes into sources are not tracked."""
    m = torch.nn.Module()
    m.w = _param(8, 8)
    own = pattern((8, 8), 4).clone()  # the values of o.weight, in writable memory
    sources = CheckpointSources()
    assert sources.register(own, read_header(checkpoint)["o.weight"], checkpoint.name)
    with WriteObserver(sources) as observer:
        m.w.data[:4].copy_(own[:4])
        own.mul_(2)
        m.w.data[4:].copy_(own[4:])
    assert [(r.offset_bytes, r.size_bytes) for r in _ranges(m, observer)] == [(0, 64)]


def test_non_checkpoint_source_and_broadcast_are_residual(checkpoint: Path) -> None:
    """A copy from a computed tensor, and a broadcasting copy from a checkpoint row, are residual."""
    m = torch.nn.Module()
    m.w = _param(8, 8)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.w.data[:4].copy_(t["k.weight"] * 1)
        m.w.data[4:].copy_(t["norm.weight"].expand(4, 8))
    assert _ranges(m, observer) == []
    assert observer.checkpoint_copies == 0


def test_another_storage_at_a_source_address_is_not_a_source(checkpoint: Path) -> None:
    """A tensor built over the same memory as a registered source, but with its own storage (what
    an address reuse after the source was freed looks like), is not a checkpoint source. Fails if
    sources are looked up by address alone."""
    m = torch.nn.Module()
    m.w = _param(8, 8)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        source = t["o.weight"]
        raw = (ctypes.c_char * 128).from_address(source.data_ptr())
        alias = torch.frombuffer(raw, dtype=torch.bfloat16).view(8, 8)
        assert alias.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
        m.w.data.copy_(alias)
    assert _ranges(m, observer) == []


def test_sources_are_forgotten_when_their_storage_dies(checkpoint: Path) -> None:
    """The source index holds no tensor alive and drops an entry when its storage is freed."""
    sources = CheckpointSources()
    tensor = pattern((8, 8), 4).clone()
    assert sources.register(tensor, read_header(checkpoint)["o.weight"], checkpoint.name)
    assert len(sources) == 1
    del tensor
    gc.collect()
    assert len(sources) == 0


def test_mismatching_tensor_is_not_registered(checkpoint: Path) -> None:
    """A yielded tensor whose dtype or shape differs from its header entry (a converted or
    reconstructed tensor) is not a source, and is counted as unknown."""
    sources = CheckpointSources()
    location = read_header(checkpoint)["o.weight"]
    assert not sources.register(pattern((8, 8), 0, torch.float32), location, checkpoint.name)
    assert not sources.register(pattern((4, 16), 0), location, checkpoint.name)
    assert not sources.register(pattern((8, 8), 0), None, None)
    assert len(sources.unknown) == 3


def test_a_write_through_a_wrapper_subclass_leaves_the_load_unclassified(checkpoint: Path) -> None:
    """A wrapper tensor subclass (DTensor, torchao) writes its inner tensor below the observer, so
    the bytes it changes are unknown: here it overwrites a recorded checkpoint copy. The load runs on
    and ``model_records`` refuses with the typed error naming the operator and the type. Fails if its
    storage's ``data_ptr`` RuntimeError escapes from the dispatch mode (the engine's load crashes), or
    if the stale record of ``o.weight`` is still returned (a capture would pack bytes the
    parameter no longer holds)."""
    m = torch.nn.Module()
    m.w = _param(8, 8)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.w.data.copy_(t["o.weight"])
        WrapperTensor(m.w.data).fill_(1.0)
    assert bool((m.w == 1).all())  # the write did land, unseen
    assert observer.unattributed_writes == [f"aten.fill_.Scalar into a {WrapperTensor.__module__}.WrapperTensor"]
    with pytest.raises(ObserverError, match=r"1 write\(s\) went into tensors without a data pointer, first aten.fill_.Scalar"):
        observer.model_records()


def test_a_wrapper_subclass_is_never_a_checkpoint_source(checkpoint: Path) -> None:
    """A yielded wrapper tensor is not registered (counted unknown), and a copy from one into a
    parameter is a residual write, not an error. Fails if registering or looking up a source reads
    its storage's ``data_ptr`` unguarded (RuntimeError)."""
    location = read_header(checkpoint)["o.weight"]
    sources = CheckpointSources()
    wrapped = WrapperTensor(pattern((8, 8), 0))
    assert not sources.register(wrapped, location, checkpoint.name)
    assert sources.unknown == ["o.weight"] and len(sources) == 0
    m = torch.nn.Module()
    m.w = _param(8, 8)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.w.data.copy_(t["o.weight"])
        m.w.data.copy_(WrapperTensor(t["q.weight"].clone()))
    assert observer.model_records() == () and observer.other_writes == 1 and not observer.unattributed_writes


def test_a_write_through_a_jagged_nested_tensor_leaves_the_load_unclassified(checkpoint: Path) -> None:
    """A jagged nested tensor (``torch.nested.nested_tensor_from_jagged``: a wrapper subclass with
    layout ``torch.jagged``) over a parameter writes the parameter below the observer, like any
    wrapper subclass: ``model_records`` refuses. Fails if a write into a tensor of a non-strided
    layout is skipped unseen (the stale record of ``k.weight`` is then returned, and a capture would
    pack bytes the parameter no longer holds)."""
    m = torch.nn.Module()
    m.w = _param(4, 8)
    jagged = torch.nested.nested_tensor_from_jagged(m.w.data, torch.tensor([0, 1, 4]))
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.w.data.copy_(t["k.weight"])
        jagged.mul_(0)
    assert bool((m.w == 0).all())  # the write did land
    assert observer.unattributed_writes == ["aten.mul_.Tensor into a torch.nested._internal.nested_tensor.NestedTensor"]
    with pytest.raises(ObserverError, match=r"1 write\(s\) went into tensors without a data pointer, first aten.mul_.Tensor"):
        observer.model_records()


def test_a_strided_nested_tensor_write_is_residual_over_its_whole_storage(checkpoint: Path) -> None:
    """A strided nested tensor (``NestedTensorImpl``: a data pointer, but no sizes or strides, so
    ``shape`` raises ``RuntimeError``) viewing part of a parameter: a write into it makes its whole
    storage residual (its elements cannot be bounded more tightly), a copy between nested tensors
    likewise; one viewing a checkpoint tensor takes that tensor out of the sources when written; a
    yielded one is no source. Fails if the observer reads its shape or strides (the RuntimeError then
    escapes from the dispatch mode and the engine's load crashes), or if the written checkpoint
    tensor stays a source (a later copy from it would be recorded as the file's bytes)."""
    location = read_header(checkpoint)["o.weight"]
    sizes, strides, offsets = torch.tensor([[8], [8]]), torch.tensor([[1], [1]]), torch.tensor([0, 8])
    assert not CheckpointSources().register(torch.nested.nested_tensor([pattern((8,), 0)] * 8), location, checkpoint.name)
    m = torch.nn.Module()
    m.w, m.v, m.u = _param(8, 8), _param(4, 8), _param(8, 8)
    first_rows = torch._nested_view_from_buffer(m.w.data.view(-1), sizes, strides, offsets)
    with open_checkpoint(checkpoint) as (sources, t):
        q_rows = torch._nested_view_from_buffer(t["q.weight"].view(-1), sizes, strides, offsets)
        with WriteObserver(sources) as observer:
            m.w.data.copy_(t["o.weight"])
            m.v.data.copy_(t["k.weight"])
            first_rows.add_(1)
            first_rows.copy_(torch._nested_view_from_buffer(pattern((64,), 0), sizes, strides, offsets))
            q_rows.mul_(2)
            m.u.data.copy_(t["q.weight"])
    assert observer.other_writes == 4 and not observer.unattributed_writes
    records = observer.model_records()
    assert [(r.source.tensor_name, r.size_bytes) for r in records] == [("k.weight", 64)]
    assert records[0].address == m.v.untyped_storage().data_ptr()


def test_writes_outside_model_allocations_are_ignored(checkpoint: Path) -> None:
    """A checkpoint copy into a temporary that is not a parameter or buffer is not a model write."""
    m = torch.nn.Module()
    m.w = _param(8, 8)
    scratch = torch.zeros(8, 8, dtype=torch.bfloat16)
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        scratch.copy_(t["o.weight"])
        m.w.data.copy_(t["q.weight"])
    ranges, kept = map_to_allocations(observer.model_records(), enumerate_allocations(m))
    assert [r.provenance.tensor_name for r in ranges] == ["q.weight"]
    assert len(observer.model_records()) == 2 and len(kept) == 1


def test_observed_bytes_round_trip_through_capture_and_hydration(checkpoint: Path, tmp_path: Path) -> None:
    """Capture a small module through the observer and the canonical writer, zero it, hydrate it:
    every byte comes back; the pack has a golden digest (it depends only on the extents' bytes).
    Fails on any change to what the observer classifies as model bytes or to the pack layout."""
    from coldsnap_core.cache.payload_cache import PayloadCache
    from coldsnap_core.capture.worker import capture_worker
    from coldsnap_core.copy.host import HostCopyBackend
    from coldsnap_core.format.manifest import WorkerIdentity
    from coldsnap_core.identity.model_identity import identify_checkpoint
    from coldsnap_core.restore.hydrate import hydrate

    m = torch.nn.Module()
    m.qkv = _param(16, 8)
    m.o = _param(8, 8)
    m.register_buffer("cache", torch.arange(6, dtype=torch.float32))
    with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
        m.qkv.data.narrow(0, 0, 8).copy_(t["q.weight"])
        m.qkv.data.narrow(0, 8, 4).copy_(t["k.weight"])
        m.qkv.data.narrow(0, 12, 4).copy_(t["v.weight"])
        m.o.data.copy_(t["down.weight"].narrow(1, 0, 8))
        m.o.data[7].fill_(3)
    allocations = enumerate_allocations(m)
    ranges, _ = map_to_allocations(observer.model_records(), allocations)
    before = [tensor_bytes(x) for x in (m.qkv, m.o, m.cache)]
    cache = PayloadCache(tmp_path / "state")
    result = capture_worker(
        allocation_map=allocations.allocation_map,
        allocations=allocations.live,
        model_ranges=ranges,
        worker=WorkerIdentity("worker", 0, 1, 0, 1),
        capture_point="portable",
        model=identify_checkpoint([checkpoint], source=str(checkpoint.parent)),
        cache=cache,
        artifact_dir=tmp_path / "artifact",
        backend=HostCopyBackend(),
    )
    assert result.manifest.model_bytes == 256 + 112
    assert result.manifest.pack.sha256 == "6a31ecc6ac1b207d42dc8a871123aaaf9b1589a9e73b73cf2c985f4b75fcd76b"
    with torch.no_grad():
        for x in (m.qkv, m.o, m.cache):
            x.zero_()
    hydrate(
        result.manifest,
        blob_path=result.capsule_dir / "weights.blob",
        cache=cache,
        allocations=allocations.live,
        backend=HostCopyBackend(),
        live_layout=enumerate_allocations(m).allocation_map,
    )
    assert [tensor_bytes(x) for x in (m.qkv, m.o, m.cache)] == before


def _load_shards(
    shards: list[Path], tmp_path: Path, label: str, *, iteration_order: list[Path] | None = None, on_device: bool = False
):
    """A generic loader over real safetensors shards through :class:`LoadSession` (what both engine
    plugins use): the shards are the prepared file list, the iterator walks ``iteration_order`` (default:
    the same order; vLLM sorts the files its own way) and yields every name of each file, and each
    yielded tensor is copied with ``copy_`` into its parameter (vLLM's default loader calls the weight
    loader once per ``(name, tensor)`` its iterator yields, so a name stored in two shards is copied
    twice); ``on_device``: it yields each tensor as a :class:`DeviceTensor` (an iterator that loads onto the
    GPU). Captured through the observer and the canonical writer; returns the capture and its ranges."""
    from coldsnap_core.cache.payload_cache import PayloadCache
    from coldsnap_core.capture.worker import capture_worker
    from coldsnap_core.copy.host import HostCopyBackend
    from coldsnap_core.format.manifest import WorkerIdentity
    from coldsnap_core.identity.model_identity import identify_checkpoint

    names: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                names.setdefault(name, f.get_slice(name))
    m = torch.nn.Module()
    m.p = torch.nn.ParameterList(
        [
            _param(*names[n].get_shape(), dtype=getattr(torch, {"BF16": "bfloat16", "F32": "float32"}[names[n].get_dtype()]))
            for n in sorted(names)
        ]
    )
    index = {n: i for i, n in enumerate(sorted(names))}
    session = LoadSession()
    session.prepared.append(PreparedWeights(str(shards[0].parent), shards[0].parent, list(shards), True))

    def iterator():
        for shard in iteration_order or shards:
            for name, tensor in _safetensors_iterator(shard):
                yield name, tensor.as_subclass(DeviceTensor) if on_device else tensor

    with WriteObserver(session.sources) as observer:
        for name, tensor in session.observe("", iterator()):
            m.p[index[name]].data.copy_(tensor)
    assert not session.sources.unknown, session.sources.unknown
    allocations = enumerate_allocations(m)
    ranges, _ = map_to_allocations(observer.model_records(), allocations)
    return capture_worker(
        allocation_map=allocations.allocation_map,
        allocations=allocations.live,
        model_ranges=ranges,
        worker=WorkerIdentity("worker", 0, 1, 0, 1),
        capture_point="portable",
        model=identify_checkpoint(list(shards), source=str(shards[0].parent)),
        cache=PayloadCache(tmp_path / f"state-{label}"),
        artifact_dir=tmp_path / f"artifact-{label}",
        backend=HostCopyBackend(),
    ), ranges


EMBED = "model.embed_tokens.weight"


def _embedding_in_two_shards(checkpoint: Path, tmp_path: Path) -> list[Path]:
    """``checkpoint``'s tensors in a first shard and its embedding stored again, byte for byte, in a second."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(checkpoint / "model.safetensors"))
    shards = tmp_path / "shards"
    shards.mkdir()
    save_file(tensors, str(shards / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file({EMBED: tensors[EMBED]}, str(shards / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    return sorted(shards.glob("*.safetensors"))


@pytest.mark.parametrize("iteration_order", ["file-list", "reversed"])
def test_a_tensor_stored_in_two_shards_with_identical_bytes_keeps_its_sharing(
    smollm2_2layer: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, iteration_order: str
) -> None:
    """The real 2-layer SmolLM2 with its embedding (80 % of the bytes) stored again, byte for byte, in a
    second shard, loaded through ``LoadSession`` (both engines' path), whose iterator yields the name once
    per file, in the prepared order or reversed (an engine that walks its files in another order). Each
    yield gets the provenance of the file whose stored bytes it holds; the second copy fully overwrites the
    first, so the bytes stay model bytes and the pack digest equals the single-file checkpoint's, with
    the same residual size and no WARNING. Fails if a name found in two files gets no provenance (the
    embedding then goes to the residual blob, another pack digest) or the wrong file's."""
    single, _ = _load_shards([smollm2_2layer / "model.safetensors"], tmp_path, "single")
    files = _embedding_in_two_shards(smollm2_2layer, tmp_path)
    order = files if iteration_order == "file-list" else files[::-1]
    with caplog.at_level("WARNING", logger="coldsnap_core.capture.observer"):
        duplicated, ranges = _load_shards(files, tmp_path, "duplicated", iteration_order=order)
    assert duplicated.manifest.pack.sha256 == single.manifest.pack.sha256
    assert duplicated.manifest.residual.size_bytes == single.manifest.residual.size_bytes
    provenance = {r.provenance.checkpoint_file for r in ranges if r.provenance.tensor_name == EMBED}
    # Identical copies: either file is the truth; in file-list order the yield count picks the later one.
    assert provenance == {order[-1].name} if iteration_order == "file-list" else len(provenance) == 1
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_tensor_stored_in_two_shards_keeps_its_sharing_when_the_iterator_yields_device_tensors(
    smollm2_2layer: Path, tmp_path: Path
) -> None:
    """The two-shard SmolLM2 of the test above, its iterator yielding device tensors (:class:`DeviceTensor`:
    ``device`` is ``cuda:0``, ``numpy()`` refused as on a GPU): the name stored in both shards still gets the
    provenance of a file that stores its bytes, so the pack digest and residual size equal the single-file
    host load's. Fails if the stored bytes are compared only for host tensors (on a GPU the embedding then
    has no provenance, goes to the residual blob and changes the pack digest)."""
    single, _ = _load_shards([smollm2_2layer / "model.safetensors"], tmp_path, "single")
    with pytest.raises(TypeError, match="cuda:0"):
        torch.zeros(2).as_subclass(DeviceTensor).numpy()
    on_device, ranges = _load_shards(_embedding_in_two_shards(smollm2_2layer, tmp_path), tmp_path, "device", on_device=True)
    assert on_device.manifest.pack.sha256 == single.manifest.pack.sha256
    assert on_device.manifest.residual.size_bytes == single.manifest.residual.size_bytes
    assert {r.provenance.tensor_name for r in ranges} >= {EMBED}


def test_a_name_in_two_files_with_other_bytes_takes_the_file_it_was_read_from(tmp_path: Path) -> None:
    """Two files store one name with different bytes and the iterator reads them in reverse file order:
    each yielded tensor is registered with the file whose bytes it holds, so the destination's final bytes
    (the last copy) carry that file's provenance. Fails if the k-th yield is blindly given the k-th file."""
    from safetensors.torch import save_file

    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"o.weight": pattern((8, 8), 1)}, str(first))
    save_file({"o.weight": pattern((8, 8), 2)}, str(second))
    session = LoadSession()
    session.prepared.append(PreparedWeights(str(tmp_path), tmp_path, [first, second], True))
    m = torch.nn.Module()
    m.w = _param(8, 8)

    def iterator():
        yield from _safetensors_iterator(second)
        yield from _safetensors_iterator(first)

    with WriteObserver(session.sources) as observer:
        for _, tensor in session.observe("", iterator()):
            m.w.data.copy_(tensor)
    assert not session.sources.unknown
    (r,) = _ranges(m, observer)
    assert r.provenance.checkpoint_file == first.name
    assert tensor_bytes(m.w) == file_bytes(first, r.provenance.source_offset_bytes, 128)


def test_a_later_checkpoint_copy_with_other_bytes_wins_with_one_warning(checkpoint: Path, tmp_path: Path, caplog) -> None:
    """A name stored in two files with different bytes: the later copy's bytes are what the destination
    holds, so they are the model bytes (later provenance, checked against the file), and one WARNING
    names both files and the tensor. Fails if the warning is missing or repeated, or the earlier
    provenance is kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"o.weight": pattern((8, 8), 9)}, str(other))
    m = torch.nn.Module()
    m.w = _param(8, 8)
    header = read_header(other)
    with (
        caplog.at_level("WARNING", logger="coldsnap_core.capture.observer"),
        open_checkpoint(checkpoint) as (sources, t),
        WriteObserver(sources) as observer,
        safe_open(str(other), framework="pt") as f,
    ):
        m.w.data.copy_(t["o.weight"])
        later = f.get_tensor("o.weight")
        assert sources.register(later, header["o.weight"], other.name)
        m.w.data.copy_(later)
    (r,) = _ranges(m, observer)
    assert (r.offset_bytes, r.size_bytes, r.provenance.checkpoint_file) == (0, 128, other.name)
    assert tensor_bytes(m.w) == file_bytes(other, r.provenance.source_offset_bytes, 128)
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING"]
    assert len(warnings) == 1 and checkpoint.name in warnings[0] and other.name in warnings[0] and "o.weight" in warnings[0]


class _CountingObserver(WriteObserver):
    """A write observer that records the name of every operator it is shown."""

    def __init__(self, sources: CheckpointSources) -> None:
        super().__init__(sources)
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.seen.append(str(func))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _safetensors_iterator(path: Path):
    """``safetensors_weights_iterator``'s lazy strategy (vLLM ``weight_utils.py``): one ``get_tensor`` per name."""
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            yield name, f.get_tensor(name)


def test_the_checkpoint_iterator_runs_outside_the_observer(checkpoint: Path) -> None:
    """``LoadSession.observe`` sets the observer aside while the iterator makes each tensor, and puts it
    back for the consumer's copies. Fails if the iterator's own operators (safetensors'
    ``empty``/``set_``/``lift_fresh``...) reach the observer again, or if the observer is not back in
    place after the iterator is exhausted (the copies after the loop would go unseen)."""
    session = LoadSession()
    session.prepared.append(PreparedWeights(str(checkpoint.parent), checkpoint.parent, [checkpoint], True))
    m = torch.nn.Module()
    m.w = _param(8, 8)
    m.n = _param(8)
    held = {}
    with _CountingObserver(session.sources) as observer:
        for name, tensor in session.observe("", _safetensors_iterator(checkpoint)):
            held[name] = tensor
            if name == "o.weight":
                m.w.data.copy_(tensor)  # consumed inside the loop
        m.n.data.copy_(held["norm.weight"])  # consumed after the iterator is exhausted
        m.n.data[0:1].fill_(0)  # a write after the loop is observed too
    assert session.sources.registered == 7
    assert observer.seen.count("aten.copy_.default") == 2
    assert not {"aten.empty.memory_format", "aten.set_.source_Storage", "aten.lift_fresh.default"} & set(observer.seen)
    ranges = _ranges(m, observer)
    assert sorted((r.size_bytes, r.provenance.tensor_name) for r in ranges) == [(14, "norm.weight"), (128, "o.weight")]
    _check_against_file(m, observer, checkpoint)


def test_the_iterator_stays_observed_under_a_mode_above_the_observer(checkpoint: Path) -> None:
    """When another dispatch mode is entered inside the observer, the iterator is not taken out from
    under it (only the innermost mode could be set aside), and that mode stays where it was. Fails if
    the session pops whatever mode is on top."""
    session = LoadSession()
    inner = _CountingObserver(CheckpointSources())
    with _CountingObserver(session.sources) as outer, inner:
        names = [name for name, _ in session.observe("", _safetensors_iterator(checkpoint))]
        assert _get_current_dispatch_mode_stack()[-2:] == [outer, inner]
    assert len(names) == 7
    assert "aten.set_.source_Storage" in inner.seen
    assert "aten.set_.source_Storage" in outer.seen


def test_an_iterator_error_leaves_the_observer_in_place(checkpoint: Path) -> None:
    """An exception raised by the checkpoint iterator reaches the consumer with the observer still the
    innermost mode. Fails if the mode is not pushed back when the iterator raises."""

    def broken():
        yield from list(_safetensors_iterator(checkpoint))[:1]
        raise OSError("checkpoint shard truncated")

    session = LoadSession()
    with WriteObserver(session.sources) as observer:
        with pytest.raises(OSError, match="truncated"):
            for _ in session.observe("", broken()):
                pass
        assert _get_current_dispatch_mode() is observer


class _HeldMode(TorchDispatchMode):
    """A dispatch mode of the iterator's own, which it holds across its yields."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        return func(*args, **(kwargs or {}))


def test_an_iterator_closed_early_takes_its_own_mode_and_not_the_observer(checkpoint: Path) -> None:
    """An iterator that holds a dispatch mode of its own across its yields sits below the observer
    while the consumer runs (the observer is pushed back on top of it). When the consumer stops early
    and closes the generator, the iterator's ``with`` exit pops the innermost mode: it must run with the
    observer set aside, as its ``next`` did, so that it takes its own mode off. Fails if the iterator is
    left to be closed by garbage collection under the observer (its exit then pops the observer, its own
    mode stays on the stack, and the consumer's later writes are not observed)."""

    def holding():
        with _HeldMode():
            yield from _safetensors_iterator(checkpoint)

    session = LoadSession()
    below = _get_current_dispatch_mode_stack()
    w = torch.zeros(8, dtype=torch.bfloat16)
    with WriteObserver(session.sources) as observer:
        weights = session.observe("", holding())
        for _ in weights:
            break
        weights.close()
        assert _get_current_dispatch_mode_stack() == [*below, observer]
        w.fill_(1)
    assert observer.other_writes == 1
    assert _get_current_dispatch_mode_stack() == below
