"""The checkpoint-to-destination write observer (``docs/format.md`` §6.1), a ``TorchDispatchMode`` around
``load_weights``: a same-shape ``aten.copy_`` from a checkpoint tensor records model bytes, every other write makes
its byte hull residual. Writes that bypass the dispatcher are invisible."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from coldsnap_core.capture.checkpoint_sources import CheckpointSources, data_address, dense, storage_extent_bytes
from coldsnap_core.capture.model_records import IntervalSet, ModelRecord, RecordMap
from coldsnap_core.capture.payload import ModelRange
from coldsnap_core.copy.torch_allocations import TorchAllocations
from coldsnap_core.errors import ObserverError

ConvertedCopies = Literal["residual", "model"]
logger = logging.getLogger(__name__)

_aten = torch.ops.aten
_METADATA_ONLY_OPS = frozenset(
    {
        _aten.set_.source_Storage,
        _aten.set_.source_Storage_storage_offset,
        _aten.set_.source_Tensor,
        _aten.set_.default,
        _aten.resize_.default,
    }
)


def _copy_runs(
    shape: Sequence[int], source_stride: Sequence[int], dest_stride: Sequence[int]
) -> Iterator[tuple[int, int, int, int, int]]:
    """Split an elementwise copy of ``shape`` into destination-contiguous pieces: ``(dest_offset, source_offset, units,
    run, stride)`` in elements, the destination elements ``[dest_offset, dest_offset + units)`` from source runs of
    ``run`` elements starting ``stride`` apart from ``source_offset``."""
    dims = [(int(n), int(s), int(d)) for n, s, d in zip(shape, source_stride, dest_stride, strict=True) if n != 1]
    merged: list[tuple[int, int, int]] = []
    for n, s, d in reversed(dims):  # innermost first
        if merged and s == merged[-1][0] * merged[-1][1] and d == merged[-1][0] * merged[-1][2]:
            inner = merged.pop()
            merged.append((n * inner[0], inner[1], inner[2]))
        else:
            merged.append((n, s, d))
    merged.reverse()  # outermost first
    run = merged.pop()[0] if merged and merged[-1][1] == 1 and merged[-1][2] == 1 else 1
    if not merged:
        yield 0, 0, run, run, run
        return
    rows_n, rows_s, rows_d = merged.pop()
    for index in itertools.product(*(range(n) for n, _, _ in merged)):  # the outer dimensions, outermost first
        s0 = sum(i * s for i, (_, s, _) in zip(index, merged, strict=True))
        d0 = sum(i * d for i, (_, _, d) in zip(index, merged, strict=True))
        if rows_d == run:
            yield d0, s0, rows_n * run, run, rows_s
        else:
            for i in range(rows_n):
                yield d0 + i * rows_d, s0 + i * rows_s, run, run, run


def _storage_bytes(tensor: torch.Tensor, record: ModelRecord) -> torch.Tensor:
    """The destination bytes of ``record`` in ``tensor``'s storage, as a ``uint8`` view (any device)."""
    storage = tensor.untyped_storage()
    base = storage.data_ptr()
    whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
    return whole[record.address - base : record.end - base]


class _NoData(Exception):
    """:func:`_hull` of a tensor whose storage has no data pointer (a wrapper subclass)."""


def _hull(tensor: torch.Tensor) -> tuple[int, int] | None:
    """Absolute ``[lo, hi)`` of the bytes ``tensor`` can touch (a strided nested tensor: its whole storage), or ``None``
    without elements; :class:`_NoData` when its storage has no data pointer."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return None
    addressed = data_address(tensor)
    if addressed is None:
        raise _NoData
    storage, base = addressed
    if not dense(tensor):
        return base, base + storage.nbytes()
    lo, hi = storage_extent_bytes(tensor)
    return base + lo, base + hi


@functools.cache
def _written_spec(func) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of each argument ``func``'s schema marks as written (none for a metadata-only operator)."""
    if func in _METADATA_ONLY_OPS or torch.Tag.inplace_view in getattr(func, "tags", ()):
        return ()
    schema = getattr(func, "_schema", None)
    if schema is None:
        return ()
    return tuple((i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


class WriteObserver(TorchDispatchMode):
    """Observe every tensor write while active; ``unattributed_writes``: the writes into tensors without a data pointer."""

    def __init__(self, sources: CheckpointSources, *, converted_copies: ConvertedCopies = "model") -> None:
        super().__init__()
        self.sources = sources
        self.converted_copies = converted_copies
        self._records = RecordMap()
        self._copied = IntervalSet()
        self.checkpoint_copies = 0
        self.other_writes = 0
        self.unattributed_writes: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func is _aten.copy_.default:
            dest, source = args[0], args[1]
            records = self._checkpoint_records(dest, source) if isinstance(source, torch.Tensor) else None
            saved = self._overwritten_bytes(dest, records) if records else []
            result = func(*args, **kwargs)
            self._on_copy(dest, records, saved, func)
            return result
        result = func(*args, **kwargs)
        for position, name in _written_spec(func):
            value = args[position] if position < len(args) else kwargs.get(name)
            for tensor in value if isinstance(value, list | tuple) else (value,):
                if isinstance(tensor, torch.Tensor):
                    self._on_write(tensor, func)
        return result

    def _on_write(self, tensor: torch.Tensor, func: object) -> None:
        try:
            hull = _hull(tensor)
        except _NoData:
            # its bytes go to inner tensors this mode never sees: model_records then refuses to classify anything
            self.unattributed_writes.append(f"{func} into a {type(tensor).__module__}.{type(tensor).__qualname__}")
            return
        if hull is None:
            return
        self.other_writes += 1
        self.sources.taint(tensor)
        self._records.remove(*hull)

    def _overwrite(self, record: ModelRecord) -> tuple[list[tuple[int, int]], list[ModelRecord] | None]:
        """The parts of ``record``'s range no earlier checkpoint copy wrote, and the earlier records it fully overwrites."""
        fresh = self._copied.uncovered(record.address, record.end)
        copied = record.size_bytes - sum(b - a for a, b in fresh)
        return fresh, self._records.fully_overwritten(record.address, record.end, copied)

    def _overwritten_bytes(self, dest: torch.Tensor, records: list[ModelRecord]) -> list[tuple[ModelRecord, torch.Tensor]]:
        """Before a checkpoint ``copy_``: each earlier record it will fully overwrite, with a copy of its bytes."""
        saved = []
        for record in records:
            for earlier in self._overwrite(record)[1] or ():
                saved.append((earlier, _storage_bytes(dest, earlier).clone()))
        return saved

    def _on_copy(
        self,
        dest: torch.Tensor,
        records: list[ModelRecord] | None,
        saved: list[tuple[ModelRecord, torch.Tensor]],
        func: object,
    ) -> None:
        if records is None:
            self._on_write(dest, func)
            return
        self.sources.taint(dest)
        self.checkpoint_copies += 1
        for record in records:
            lo, hi = record.address, record.end
            fresh, overwritten = self._overwrite(record)
            self._records.remove(lo, hi)
            if overwritten is not None:  # the destination holds exactly this source: all of it is this record's
                self._records.add(record)
            else:
                for a, b in fresh:
                    for piece in record.slice(a - lo, b - lo):
                        self._records.add(piece)
            self._copied.add(lo, hi)
        changed = [earlier for earlier, before in saved if not torch.equal(_storage_bytes(dest, earlier), before)]
        if changed:
            earlier = sorted({f"{r.source.tensor_name} of {r.source.checkpoint_file}" for r in changed})
            later = records[0].source
            logger.warning(
                "coldsnap: checkpoint tensor %s of %s overwrote other bytes that %s had written into the same"
                " destination; the later copy's bytes are the model bytes (the checkpoint stores one tensor"
                " name twice with different values)",
                later.tensor_name,
                later.checkpoint_file,
                ", ".join(earlier),
            )

    def _checkpoint_records(self, dest: torch.Tensor, source: torch.Tensor) -> list[ModelRecord] | None:
        if dest.numel() == 0 or not dense(dest) or not dense(source) or dest.device.type == "meta":
            return None
        if tuple(source.shape) != tuple(dest.shape):
            return None  # broadcasting: not a verbatim copy
        if any(s <= 0 for t in (dest, source) for n, s in zip(t.shape, t.stride(), strict=True) if n > 1):
            return None  # overlapping elements
        found = self.sources.find(source)
        if found is None:
            return None
        span, offset_in_tensor = found
        converted = source.dtype != dest.dtype
        if converted and self.converted_copies != "model":
            return None
        addressed = data_address(dest)
        if addressed is None:
            return None  # a wrapper destination: an unattributed write (_on_write)
        s_item, d_item = source.element_size(), dest.element_size()
        dest_base = addressed[1] + int(dest.storage_offset()) * d_item
        # units: elements for a converted copy, bytes for a byte-exact one
        unit_s, unit_d, scale_s = (s_item, d_item, 1) if converted else (1, 1, s_item)
        first0 = offset_in_tensor // unit_s
        return [
            ModelRecord(
                address=dest_base + d_off * d_item,
                size_bytes=units * d_item,
                source=span,
                source_first=first0 + s_off * scale_s,
                run=run * scale_s,
                stride=stride * scale_s,
                unit_source_bytes=unit_s,
                unit_destination_bytes=unit_d,
                dtype_converted=converted,
            )
            for d_off, s_off, units, run, stride in _copy_runs(dest.shape, source.stride(), dest.stride())
        ]

    def model_records(self) -> tuple[ModelRecord, ...]:
        """The model records, sorted by address and disjoint (absolute addresses).

        Raises:
            ObserverError: an operator wrote into a tensor without a data pointer (names the first and the count).
        """
        if self.unattributed_writes:
            raise ObserverError(
                f"{len(self.unattributed_writes)} write(s) went into tensors without a data pointer, first"
                f" {self.unattributed_writes[0]} (a wrapper tensor subclass writes its inner tensors below the"
                " observer); which bytes they changed is unknown, so this load's bytes are not classified"
            )
        return tuple(self._records.records)

    def loaded_records(self, before: TorchAllocations, after: TorchAllocations) -> tuple[ModelRecord, ...]:
        """:meth:`model_records` of a whole ``load_weights`` whose allocations were ``before`` and are ``after`` now.

        Raises:
            ObserverError: a weight loader rebound a parameter's or buffer's storage, or see :meth:`model_records`.
        """
        if not after.same_storages(before):
            raise ObserverError(
                "the model's parameter or buffer storages changed during load_weights (a weight loader rebound"
                " a parameter); its writes cannot be mapped onto the portable allocations"
            )
        return self.model_records()


def map_to_allocations(
    records: Iterable[ModelRecord], allocations: TorchAllocations
) -> tuple[list[ModelRange], list[ModelRecord]]:
    """Map absolute model records onto the portable allocations: ``(model ranges, records kept)``, sorted; the rest is dropped."""
    ranges = []
    kept = []
    for record in records:
        for index, offset, size in allocations.locate(record.address, record.size_bytes):
            start = allocations.live[index].address + offset - record.address
            for piece in record.slice(start, start + size):
                kept.append(piece)
                ranges.append(
                    ModelRange(index, piece.address - allocations.live[index].address, piece.size_bytes, piece.provenance())
                )
    ranges.sort(key=lambda r: (r.allocation_index, r.offset_bytes))
    kept.sort(key=lambda r: r.address)
    return ranges, kept
