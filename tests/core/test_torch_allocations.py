"""coldsnap_core.copy.torch_allocations: the portable allocations of a torch module.

The enumeration decides the layout fingerprint that a restore compares, so these tests pin the
order, the aliasing rules and every refusal.
"""

from __future__ import annotations

import pytest
import torch

from coldsnap_core.copy.torch_allocations import enumerate_allocations
from coldsnap_core.errors import ObserverError
from tests.support.observer_support import WrapperTensor


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer("scale", torch.ones(1))


def model() -> torch.nn.Module:
    m = torch.nn.Module()
    m.embed = torch.nn.Parameter(torch.zeros(10, 6, dtype=torch.bfloat16), requires_grad=False)
    m.layers = torch.nn.ModuleList([Block(), Block()])
    m.head = torch.nn.Module()
    m.head.weight = m.embed
    return m


def test_order_tags_and_placements() -> None:
    """Parameters first (in ``named_parameters`` order), then buffers; aliases join the allocation
    of the storage they share; placements give dtype, shape, stride (elements) and byte offset."""
    allocations = enumerate_allocations(model())
    amap = allocations.allocation_map
    assert [(a.tag, [t.name for t in a.tensors]) for a in amap.allocations] == [
        ("parameter", ["embed", "head.weight"]),
        ("parameter", ["layers.0.weight"]),
        ("parameter", ["layers.1.weight"]),
        ("buffer", ["layers.0.scale"]),
        ("buffer", ["layers.1.scale"]),
    ]
    first = amap[1].tensors[0]
    assert (first.dtype, first.shape, first.stride, first.offset_bytes) == ("bfloat16", (4, 6), (6, 1), 0)
    assert [a.size_bytes for a in amap.allocations] == [120, 48, 48, 4, 4]
    assert [a.address for a in amap.allocations] == [None] * 5
    assert [a.index for a in allocations.live] == [0, 1, 2, 3, 4]
    assert allocations.total_bytes == 224


def test_fingerprint_is_stable_and_sensitive() -> None:
    """Two builds of the same model have one fingerprint (addresses do not enter it); a changed
    dtype, shape or extra layer changes it."""
    a, b = enumerate_allocations(model()), enumerate_allocations(model())
    assert a.live != b.live
    assert a.allocation_map.layout_fingerprint() == b.allocation_map.layout_fingerprint()
    other = model()
    other.layers[1].weight = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.float16), requires_grad=False)
    assert enumerate_allocations(other).allocation_map.layout_fingerprint() != a.allocation_map.layout_fingerprint()
    other = model()
    other.layers.append(Block())
    assert enumerate_allocations(other).allocation_map.layout_fingerprint() != a.allocation_map.layout_fingerprint()


def test_views_share_their_storage_allocation() -> None:
    """A parameter that is a view into another's storage (offset, stride) is a further tensor of
    that allocation with its byte offset."""
    m = torch.nn.Module()
    base = torch.zeros(8, 4, dtype=torch.float32)
    m.a = torch.nn.Parameter(base, requires_grad=False)
    m.b = torch.nn.Parameter(base[2:4].t(), requires_grad=False)
    (allocation,) = enumerate_allocations(m).allocation_map.allocations
    b = allocation.tensors[1]
    assert (b.name, b.shape, b.stride, b.offset_bytes) == ("b", (4, 2), (1, 4), 32)


def test_locate_splits_ranges_and_skips_foreign_memory() -> None:
    """``locate`` maps an absolute range onto (allocation, offset, size); memory outside every
    allocation is skipped."""
    m = model()
    allocations = enumerate_allocations(m)
    weight = allocations.live[1]
    assert list(allocations.locate(weight.address + 8, 16)) == [(1, 8, 16)]
    scratch = torch.zeros(16)
    assert list(allocations.locate(scratch.data_ptr(), 64)) == []


def test_storages_are_kept_alive() -> None:
    """The enumeration holds the storages, so a background reader may outlive the module's tensors
    (vLLM's CPU post-processing replaces every linear weight)."""
    m = model()
    allocations = enumerate_allocations(m)
    address = allocations.live[1].address
    m.layers[0].weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    assert allocations.storages[1].data_ptr() == address


def test_meta_tensors_are_refused() -> None:
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.empty(4, device="meta"), requires_grad=False)
    with pytest.raises(ObserverError, match="tensor w is on the meta device"):
        enumerate_allocations(m)


def test_unknown_dtype_is_refused() -> None:
    m = torch.nn.Module()
    m.register_buffer("bits", torch.empty(2, dtype=torch.bits16))
    with pytest.raises(ObserverError, match="dtype bits16"):
        enumerate_allocations(m)


def test_overlapping_storages_are_refused() -> None:
    """Two distinct storages over overlapping memory: hydrating one would write into the other."""
    memory = bytearray(64)
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.frombuffer(memory, dtype=torch.uint8, count=32), requires_grad=False)
    m.b = torch.nn.Parameter(torch.frombuffer(memory, dtype=torch.uint8, count=32, offset=16), requires_grad=False)
    with pytest.raises(ObserverError, match="overlap in memory"):
        enumerate_allocations(m)


def test_same_address_with_another_size_is_refused() -> None:
    """Two storages starting at one address with different sizes cannot be one allocation."""
    memory = bytearray(64)
    m = torch.nn.Module()
    m.a = torch.nn.Parameter(torch.frombuffer(memory, dtype=torch.uint8, count=32), requires_grad=False)
    m.b = torch.nn.Parameter(torch.frombuffer(memory, dtype=torch.uint8, count=16), requires_grad=False)
    with pytest.raises(ObserverError, match="shares address"):
        enumerate_allocations(m)


def test_tensors_without_storage_are_refused() -> None:
    """A sparse (or other storage-less) parameter has no bytes to capture."""
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.eye(3).to_sparse(), requires_grad=False)
    with pytest.raises(ObserverError, match="tensor w has no storage"):
        enumerate_allocations(m)


class _CountingParameter(torch.nn.Parameter):
    """A parameter that overrides ``__torch_function__``, as vLLM's ``BasevLLMParameter`` does
    (``vllm/model_executor/parameter.py``), and counts the calls it sees."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_parameter_subclasses_are_enumerated_without_their_torch_function() -> None:
    """A ``__torch_function__`` override is not run for the enumeration's queries, and the result is
    the one plain parameters give. Fails if the override is entered again (about 1,000 Python calls
    in a 270-tensor vLLM model, 15 ms instead of 6) or if disabling it changed a shape, stride or
    address."""
    data = [torch.zeros(6, 4, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.float32)]
    plain, counted = torch.nn.Module(), torch.nn.Module()
    plain.w, plain.b = (torch.nn.Parameter(t, requires_grad=False) for t in data)
    counted.w, counted.b = (_CountingParameter(t, requires_grad=False) for t in data)
    counted.v = torch.nn.Parameter(counted.w.data[2:], requires_grad=False)
    plain.v = torch.nn.Parameter(plain.w.data[2:], requires_grad=False)
    _CountingParameter.calls = 0
    got = enumerate_allocations(counted)
    assert _CountingParameter.calls == 0
    want = enumerate_allocations(plain)
    assert got.live == want.live
    assert got.allocation_map == want.allocation_map
    assert [p.offset_bytes for p in got.allocation_map.allocations[0].tensors] == [0, 16]


def test_wrapper_subclasses_without_data_are_refused() -> None:
    """A wrapper-subclass parameter or buffer is refused with the typed error (the loaders then load
    without observing). Fails if its storage's ``data_ptr`` RuntimeError ("invalid python storage")
    escapes untyped."""
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(WrapperTensor(torch.zeros(3)), requires_grad=False)
    with pytest.raises(ObserverError, match="tensor w has no storage"):
        enumerate_allocations(m)
    m = torch.nn.Module()
    m.register_buffer("b", WrapperTensor(torch.zeros(3)))
    with pytest.raises(ObserverError, match="tensor b has no storage"):
        enumerate_allocations(m)


class _NoneMembers(torch.nn.Module):
    """A module with a ``None`` parameter and buffer slot (as ``bias=False`` layers register them)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("bias", None)
        self.register_buffer("running", None)
        self.weight = torch.nn.Parameter(torch.zeros(2), requires_grad=False)


class _SkipsHead(torch.nn.Module):
    """A module whose ``named_parameters`` leaves a parameter out (as wrappers such as FSDP reshape theirs)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = model()

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, parameter in super().named_parameters(prefix, recurse, remove_duplicate):
            if not name.endswith("head.weight"):
                yield name, parameter


def _instance_override() -> torch.nn.Module:
    """A module whose instance (not its class) replaces ``named_parameters``, as patching wrappers do."""
    m = model()
    named = m.named_parameters
    m.named_parameters = lambda *args, **kwargs: ((n, p) for n, p in named(*args, **kwargs) if n != "head.weight")
    return m


class _PositionalPrefix(torch.nn.Module):
    """A module whose ``named_modules`` takes ``prefix`` positionally first (torch passes it by keyword)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = model()

    def named_modules(self, prefix, remove_duplicate=True, memo=None):  # type: ignore[override]
        return super().named_modules(memo, prefix, remove_duplicate)


@pytest.mark.parametrize(
    "build",
    [model, _NoneMembers, _SkipsHead, _instance_override, _PositionalPrefix],
    ids=["plain", "none-slots", "overridden", "instance-override", "positional-prefix"],
)
def test_the_walk_names_what_named_parameters_then_named_buffers_name(build) -> None:
    """The enumeration walks the module tree once for parameters and buffers together. Fails if that walk
    names another tensor, order or tag than ``named_parameters(remove_duplicate=False)`` followed by
    ``named_buffers(remove_duplicate=False)`` would: a ``None`` slot listed, a buffer before a parameter, an
    alias dropped, or a module's own ``named_parameters`` override ignored."""
    module = build()
    expected = [("parameter", n, t) for n, t in module.named_parameters(remove_duplicate=False)]
    expected += [("buffer", n, t) for n, t in module.named_buffers(remove_duplicate=False)]
    amap = enumerate_allocations(module).allocation_map
    enumerated = [(a.tag if t is a.tensors[0] else None, t.name) for a in amap.allocations for t in a.tensors]
    first_tags = {name: tag for tag, name in enumerated if tag is not None}
    names = [name for _, name in enumerated]
    assert sorted(names) == sorted(name for _, name, _ in expected)
    by_name = {name: (tag, tensor) for tag, name, tensor in expected}
    for name, tag in first_tags.items():
        assert by_name[name][0] == tag
    order = [name for _, name, _ in expected]
    firsts = [a.tensors[0].name for a in amap.allocations]
    assert firsts == sorted(firsts, key=order.index), "allocations follow the order the tensors are first reached"
