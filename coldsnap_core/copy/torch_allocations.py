"""Portable allocations: a torch module's parameter and buffer storages, in the deterministic order of
``docs/format.md`` §6.1 (a tensor sharing an earlier storage, a tied weight or a view, is a further tensor of it).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from coldsnap_core.errors import ObserverError
from coldsnap_core.format.allocation import DTYPE_ITEMSIZE_BYTES, Allocation, AllocationMap, LiveAllocation, TensorPlacement

PARAMETER_TAG = "parameter"
"""Tag of an allocation first reached through ``named_parameters``."""
BUFFER_TAG = "buffer"
"""Tag of an allocation first reached through ``named_buffers``."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16`` (the names of :data:`DTYPE_ITEMSIZE_BYTES`)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, eq=False)
class TorchAllocations:
    """A module's parameter and buffer storages as allocations.

    Attributes:
        allocation_map: the layout (index, size, tag, hosted tensors); ``address`` is ``None``.
        live: the allocations' current addresses (``UntypedStorage.data_ptr()``) and sizes, by index.
        device: the device every allocation lives on.
        storages: the storages, by index, kept alive so the addresses in ``live`` stay valid even if the engine
            drops the tensors (vLLM's CPU post-processing replaces every linear weight).
    """

    allocation_map: AllocationMap
    live: tuple[LiveAllocation, ...]
    device: torch.device
    storages: tuple[torch.UntypedStorage, ...]

    @functools.cached_property
    def _by_address(self) -> tuple[list[int], list[int]]:
        order = sorted(range(len(self.live)), key=lambda i: self.live[i].address)
        return order, [self.live[i].address for i in order]

    @property
    def total_bytes(self) -> int:
        return sum(a.size_bytes for a in self.live)

    def same_storages(self, other: TorchAllocations) -> bool:
        """Whether ``other`` enumerates the same storages at the same addresses with the same layout."""
        return self.live == other.live and self.allocation_map == other.allocation_map

    def locate(self, address: int, size_bytes: int) -> Iterator[tuple[int, int, int]]:
        """Split the absolute byte range ``[address, address + size_bytes)`` over the allocations: yield
        ``(allocation index, offset_bytes, size_bytes)`` per part inside one, in address order (the rest is skipped)."""
        end = address + size_bytes
        order, starts = self._by_address
        position = max(0, bisect.bisect_right(starts, address) - 1)
        while position < len(order) and starts[position] < end:
            allocation = self.live[order[position]]
            lo = max(address, allocation.address)
            hi = min(end, allocation.address + allocation.size_bytes)
            if lo < hi:
                yield allocation.index, lo - allocation.address, hi - lo
            position += 1


def _placement(name: str, tensor: torch.Tensor) -> TensorPlacement:
    dtype = _DTYPE_NAMES.get(tensor.dtype) or dtype_name(tensor.dtype)
    if dtype not in DTYPE_ITEMSIZE_BYTES:
        raise ObserverError(f"tensor {name} has dtype {dtype}, which the allocation map cannot describe")
    return TensorPlacement(
        name=name,
        dtype=dtype,
        shape=tuple(tensor.shape),  # torch.Size is a tuple of Python ints
        stride=tensor.stride(),  # a tuple of Python ints
        offset_bytes=tensor.storage_offset() * tensor.element_size(),
    )


_DTYPE_NAMES: dict[torch.dtype, str] = {
    dtype: dtype_name(dtype) for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)
}
"""Each torch dtype's name, computed once."""


def enumerate_allocations(module: torch.nn.Module) -> TorchAllocations:
    """Enumerate ``module``'s parameter and buffer storages (``docs/format.md`` §6.1).

    Raises:
        ObserverError: a tensor is on the meta device or has no storage (a tensor subclass without data), tensors
            live on more than one device, a dtype has no entry in
            :data:`~coldsnap_core.format.allocation.DTYPE_ITEMSIZE_BYTES`, or two storages overlap in memory.
    """
    # vLLM's parameters (vllm/model_executor/parameter.py) override __torch_function__, which would run their
    # Python code on every query below without changing what it returns.
    with torch._C.DisableTorchFunctionSubclass():
        return _enumerate(module)


def _enumerate(module: torch.nn.Module) -> TorchAllocations:
    # (tag, the tensors it hosts, the storage, its address, its size in bytes), by allocation index
    entries: list[tuple[str, list[tuple[str, torch.Tensor]], torch.UntypedStorage, int, int]] = []
    by_key: dict[object, int] = {}
    device: torch.device | None = None
    for tag, name, tensor in _named_tensors(module):
        if tensor.is_meta:
            raise ObserverError(f"tensor {name} is on the meta device; it has no bytes to capture or restore")
        if device is None:
            device = tensor.device
        elif tensor.device != device:
            raise ObserverError(f"tensor {name} is on {tensor.device}, earlier tensors on {device}")
        try:
            storage = tensor.untyped_storage()
            # A wrapper subclass (DTensor, torchao's quantized tensors) has a storage object without
            # data: only its data_ptr() raises ("invalid python storage").
            address = storage.data_ptr()
        except (RuntimeError, NotImplementedError) as exc:
            raise ObserverError(f"tensor {name} has no storage ({type(tensor).__name__}): {exc}") from exc
        size_bytes = storage.nbytes()
        # A storage's identity: its address for a non-empty one; the storage object for an empty one
        # (empty storages may all report address 0).
        key: object = ("ptr", address) if size_bytes else ("empty", storage._cdata)
        index = by_key.get(key)
        if index is None:
            by_key[key] = len(entries)
            entries.append((tag, [(name, tensor)], storage, address, size_bytes))
        else:
            if entries[index][4] != size_bytes:
                raise ObserverError(
                    f"tensor {name} shares address {address:#x} with {entries[index][1][0][0]}"
                    f" but its storage is {size_bytes} bytes, not {entries[index][4]}"
                )
            entries[index][1].append((name, tensor))

    allocations = []
    live = []
    for index, (tag, tensors, _, address, size_bytes) in enumerate(entries):
        placements = tuple([_placement(name, tensor) for name, tensor in tensors])
        allocations.append(Allocation(index, size_bytes, tag, None, placements))
        live.append(LiveAllocation(index, address, size_bytes))
    _check_disjoint(live, entries)
    return TorchAllocations(
        AllocationMap(tuple(allocations)),
        tuple(live),
        device if device is not None else torch.device("cpu"),
        tuple(entry[2] for entry in entries),
    )


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """``(tag, name, tensor)`` of ``named_parameters`` then ``named_buffers`` (``remove_duplicate=False``), in one
    walk of ``named_modules`` as ``Module._named_members`` does (``torch/nn/modules/module.py``), unless overridden."""
    base = torch.nn.Module
    cls = type(module)
    methods = ("named_parameters", "named_buffers", "_named_members")
    if any(getattr(cls, name) is not getattr(base, name) or name in vars(module) for name in methods):
        named = [(PARAMETER_TAG, n, t) for n, t in module.named_parameters(remove_duplicate=False)]
        return named + [(BUFFER_TAG, n, t) for n, t in module.named_buffers(remove_duplicate=False)]
    parameters: list[tuple[str, str, torch.Tensor]] = []
    buffers: list[tuple[str, str, torch.Tensor]] = []
    for prefix, submodule in module.named_modules(prefix="", remove_duplicate=False):  # as _named_members calls it
        dot = prefix + "." if prefix else ""
        parameters.extend((PARAMETER_TAG, dot + key, t) for key, t in submodule._parameters.items() if t is not None)
        buffers.extend((BUFFER_TAG, dot + key, t) for key, t in submodule._buffers.items() if t is not None)
    return parameters + buffers


def _check_disjoint(live: list[LiveAllocation], entries: list) -> None:
    ordered = sorted((a for a in live if a.size_bytes), key=lambda a: a.address)
    for before, after in itertools.pairwise(ordered):
        if before.address + before.size_bytes > after.address:
            raise ObserverError(
                f"the storages of {entries[before.index][1][0][0]} and {entries[after.index][1][0][0]} overlap in memory",
                allocation=after.index,
                offset_bytes=0,
            )
