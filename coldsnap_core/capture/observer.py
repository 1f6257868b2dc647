"""The checkpoint-to-destination write observer: which destination bytes hold checkpoint bytes.

Classification comes from observed loader behaviour, never from parameter names (``docs/format.md``
§6.1; vLLM ``model_executor/model_loader/default_loader.py`` yields each checkpoint tensor from its
weights iterator, and the model's ``weight_loader`` functions copy them into parameter views). Two
boundaries are watched:

1. **The iterator boundary** (source side). Every ``(name, tensor)`` the engine's checkpoint iterator
   yields is registered in :class:`~coldsnap_core.capture.checkpoint_sources.CheckpointSources` with the file, tensor name and file offset
   that the safetensors header gives for it (:func:`coldsnap_core.format.safetensors_header.read_header`),
   keyed by the tensor's storage. An entry lives exactly as long as that storage (a weak reference
   to the storage object, which torch keeps unique per storage), so a freed source whose address is
   reused by another tensor is never mistaken for checkpoint bytes.
2. **The write boundary** (destination side). :class:`WriteObserver` is a ``TorchDispatchMode``
   around the engine's ``load_weights``. It sees every aten operator and classifies every byte
   range it writes:

   * ``aten.copy_`` whose source is (a view of) a registered checkpoint tensor, with the same
     shape, no broadcasting and the same dtype, records *model* bytes: one record per contiguous
     destination run, each with its provenance (file, tensor, source offset, and for a strided
     source such as a row-parallel ``narrow(1, ...)`` shard, the run length and run stride).
     Stacked parameters (``qkv_proj``, ``gate_up_proj``) get one record per shard copy; a tied
     embedding is one storage, so its bytes are recorded once.
   * any other write into memory makes the written bytes *residual*: ``fill_``, ``zero_``,
     ``index_put_``, ``index_copy_``, a copy from a non-checkpoint tensor, and generally every
     operator whose schema marks an argument as written (``Tensor(a!)``, ``out=`` tensors),
     except metadata-only in-place views (tag ``inplace_view``) and ``set_``. The whole byte hull
     of the written tensor becomes residual, also when the operator writes only some of its
     elements (which ones ``index_put_`` touches depends on the index values); for a strided
     nested tensor, which has no strides to bound its elements by, its whole storage.
   * a dtype-converting ``copy_`` from a checkpoint tensor is, by default
     (``converted_copies="model"``), a model extent whose provenance says ``dtype_converted: true``:
     the destination bytes are a deterministic function of the source bytes (IEEE round to nearest
     even), so every worker that converts the same checkpoint the same way writes the same bytes,
     which the pack stores as they are and shares. ``converted_copies="residual"`` opts out
     (the converted bytes then go into each worker's own residual blob).
   * a later checkpoint copy that fully overwrites earlier checkpoint copies (every byte an earlier
     copy wrote inside its range is still a model byte of a record that lies wholly inside it: a
     tensor stored in two shards, which the engine's iterator yields twice) leaves model bytes with
     the later copy's provenance, since the destination now holds exactly that source; when the
     overwritten bytes differ from the later ones, one WARNING names both files. A checkpoint copy
     that overlaps an earlier one only partly makes the overlap residual; a write that lands
     *before* a checkpoint copy is simply overwritten by it.
   * a write into a registered checkpoint tensor removes it from the sources (its bytes are no
     longer the file's).

A byte is therefore *model* exactly when a checkpoint copy wrote it last, and no earlier write to it
was a partly overlapping checkpoint copy or another write after a checkpoint copy, until :meth:`WriteObserver.model_records` is read at the end of ``load_weights``.
Addresses are absolute; :func:`map_to_allocations` maps them onto the portable allocations and drops
writes into memory that is not a model allocation.

Limits: writes that bypass the torch dispatcher (raw pointers, ``Tensor.numpy()`` views, a custom
operator registered without alias annotations) are invisible; the loaders the project supports
(vLLM's default loader with the safetensors or InstantTensor iterator) write through ``copy_``.
The checkpoint iterator itself runs outside the observer (:meth:`~coldsnap_core.capture.load_session.LoadSession.observe`), so an
iterator that rewrites a tensor it yielded earlier is not noticed; a dispatch mode is per thread,
so an iterator's worker threads were never observed either. A wrapper tensor subclass of any
layout (DTensor, torchao, a jagged nested tensor) writes its inner tensors below this mode, as a
sparse tensor's kernels write its values: a write into one is counted in
:attr:`WriteObserver.unattributed_writes`, and then :meth:`WriteObserver.model_records` refuses to
classify anything (``docs/format.md`` §6.1, "Unclassifiable loads").
"""

from __future__ import annotations

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


# --- the source side ---------------------------------------------------------------------------


# --- model records -------------------------------------------------------------------------------


# --- decomposing a copy into runs ----------------------------------------------------------------


def _copy_runs(
    shape: Sequence[int], source_stride: Sequence[int], dest_stride: Sequence[int]
) -> Iterator[tuple[int, int, int, int, int]]:
    """Split an elementwise copy of ``shape`` into destination-contiguous pieces.

    Yields ``(dest_offset, source_offset, units, run, stride)`` in elements: the piece's
    destination elements ``[dest_offset, dest_offset + units)`` are contiguous and come from
    source runs of ``run`` elements starting ``stride`` apart from ``source_offset``.
    """
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
    outer = merged

    def combos(k: int, s0: int, d0: int) -> Iterator[tuple[int, int]]:
        if k == len(outer):
            yield s0, d0
            return
        n, s, d = outer[k]
        for i in range(n):
            yield from combos(k + 1, s0 + i * s, d0 + i * d)

    for s0, d0 in combos(0, 0, 0):
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
    """Absolute ``[lo, hi)`` of the bytes ``tensor`` can touch, or ``None`` if it has none.

    A strided nested tensor has a data pointer but no strides to bound its elements by: its hull is
    its whole storage.

    Raises:
        _NoData: ``tensor`` has elements but its storage has no data pointer (:func:`data_address`):
            a wrapper subclass of any layout (DTensor, torchao, a jagged nested tensor), a sparse or
            mkldnn tensor.
    """
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


# --- the dispatch mode ---------------------------------------------------------------------------


class WriteObserver(TorchDispatchMode):
    """Observe every tensor write while active (see the module docstring).

    Args:
        sources: the checkpoint tensors registered at the iterator boundary.
        converted_copies: ``model`` (default) or ``residual`` for dtype-converting checkpoint copies.

    Attributes:
        checkpoint_copies: number of ``copy_`` calls recorded as model bytes (for logs and tests).
        other_writes: number of other byte-writing operator calls seen.
        unattributed_writes: one line (operator, tensor type) per write into a tensor without a data
            pointer (:func:`_hull`); any makes :meth:`model_records` raise.
    """

    def __init__(self, sources: CheckpointSources, *, converted_copies: ConvertedCopies = "model") -> None:
        super().__init__()
        self.sources = sources
        self.converted_copies = converted_copies
        self._records = RecordMap()
        self._copied = IntervalSet()
        self._written_args: dict[object, tuple[tuple[int, str], ...]] = {}
        self.checkpoint_copies = 0
        self.other_writes = 0
        self.unattributed_writes: list[str] = []

    # -- dispatch ----------------------------------------------------------------------------------

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
        for tensor in self._written_tensors(func, args, kwargs):
            self._on_write(tensor, func)
        return result

    def _written_tensors(self, func, args, kwargs) -> Iterator[torch.Tensor]:
        spec = self._written_args.get(func)
        if spec is None:
            spec = self._written_spec(func)
            self._written_args[func] = spec
        for position, name in spec:
            value = args[position] if position < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, list | tuple):
                yield from (v for v in value if isinstance(v, torch.Tensor))

    @staticmethod
    def _written_spec(func) -> tuple[tuple[int, str], ...]:
        if func in _METADATA_ONLY_OPS or torch.Tag.inplace_view in getattr(func, "tags", ()):
            return ()
        schema = getattr(func, "_schema", None)
        if schema is None:
            return ()
        return tuple((i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)

    # -- classification ----------------------------------------------------------------------------

    def _on_write(self, tensor: torch.Tensor, func: object) -> None:
        try:
            hull = _hull(tensor)
        except _NoData:
            # Its bytes go to inner tensors this mode never sees, possibly over model bytes
            # recorded earlier: model_records then refuses to classify anything.
            self.unattributed_writes.append(f"{func} into a {type(tensor).__module__}.{type(tensor).__qualname__}")
            return
        if hull is None:
            return
        self.other_writes += 1
        self.sources.taint(tensor)
        self._records.remove(*hull)

    def _overwritten_bytes(self, dest: torch.Tensor, records: list[ModelRecord]) -> list[tuple[ModelRecord, torch.Tensor]]:
        """Before a checkpoint ``copy_`` runs: each earlier record it will fully overwrite, with a
        ``uint8`` copy of that record's destination bytes (to tell afterwards whether the bytes
        changed). Empty unless an earlier checkpoint copy wrote into the range (rare: a tensor name
        stored in two shards), so a plain load copies nothing here."""
        saved = []
        for record in records:
            lo, hi = record.address, record.end
            fresh = self._copied.uncovered(lo, hi)
            if fresh == [(lo, hi)]:
                continue
            for earlier in self._records.fully_overwritten(lo, hi, hi - lo - sum(b - a for a, b in fresh)) or ():
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
            fresh = self._copied.uncovered(lo, hi)
            overwritten = self._records.fully_overwritten(lo, hi, hi - lo - sum(b - a for a, b in fresh))
            self._records.remove(lo, hi)
            if overwritten is not None:
                # Every byte earlier copies wrote here is replaced by this copy: the destination
                # holds exactly this source, so the whole range is model bytes of this record.
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
        if any(s <= 0 for n, s in zip(dest.shape, dest.stride(), strict=True) if n > 1):
            return None  # overlapping destination elements
        if any(s <= 0 for n, s in zip(source.shape, source.stride(), strict=True) if n > 1):
            return None
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
        # Units: elements for a converted copy, bytes for a byte-exact one.
        if converted:
            unit_s, unit_d, scale_s = s_item, d_item, 1
            first0 = offset_in_tensor // s_item
        else:
            unit_s = unit_d = 1
            scale_s = s_item
            first0 = offset_in_tensor
        records = []
        for d_off, s_off, units, run, stride in _copy_runs(dest.shape, source.stride(), dest.stride()):
            records.append(
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
            )
        return records

    # -- results -----------------------------------------------------------------------------------

    def model_records(self) -> tuple[ModelRecord, ...]:
        """The model records, sorted by address and disjoint (absolute addresses).

        Raises:
            ObserverError: an operator wrote into a tensor whose storage has no data pointer (a
                wrapper subclass such as DTensor or a jagged nested tensor, a sparse tensor): the bytes
                it changed are unknown, so no byte is classified (the message names the first such
                operator and tensor type, and the count).
        """
        if self.unattributed_writes:
            raise ObserverError(
                f"{len(self.unattributed_writes)} write(s) went into tensors without a data pointer, first"
                f" {self.unattributed_writes[0]} (a wrapper tensor subclass writes its inner tensors below the"
                " observer); which bytes they changed is unknown, so this load's bytes are not classified"
            )
        return tuple(self._records.records)

    def loaded_records(self, before: TorchAllocations, after: TorchAllocations) -> tuple[ModelRecord, ...]:
        """:meth:`model_records` of a whole ``load_weights``, whose allocations were ``before`` as it
        started and are ``after`` now (:func:`coldsnap_core.copy.torch_allocations.enumerate_allocations`).

        Raises:
            ObserverError: a weight loader rebound a parameter's or buffer's storage (the records'
                addresses may then lie in freed memory that another tensor reuses), or see
                :meth:`model_records`.
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
    """Map absolute model records onto the portable allocations.

    Returns:
        ``(ranges, kept)``: the model ranges sorted by (allocation index, offset) for
        :func:`coldsnap_core.capture.worker.capture_worker`, and the records (or parts of records) that lie
        inside an allocation, sorted by address. Records in memory that is not a model allocation
        (a temporary, a cache outside the model) are dropped.
    """
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


# --- one observed load: the iterator boundary's bookkeeping --------------------------------------
