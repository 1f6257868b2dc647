"""Model records (``docs/format.md`` §6.1) and the interval maps the write observer keeps them in."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from coldsnap_core.capture.checkpoint_sources import SourceSpan
from coldsnap_core.format.extents import ExtentProvenance


@dataclass(frozen=True, slots=True)
class ModelRecord:
    """A contiguous destination byte range (absolute ``address``) that holds checkpoint bytes, its source in *units* (a
    byte for a byte-exact copy, an element for a dtype-converting one): destination unit ``k`` came from source unit
    ``source_first + (k // run) * stride + k % run``, counted from the checkpoint tensor's first byte; ``stride == run``
    when contiguous; ``size_bytes`` is whole destination units."""

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
        """The parts of this record inside ``[start_bytes, end_bytes)`` (relative to ``address``), each as uniform source
        runs; a cut inside a converted copy's destination element drops that element."""
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


class RecordMap:
    """Disjoint model records, sorted by address."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.records: list[ModelRecord] = []

    def remove(self, lo: int, hi: int) -> bool:
        """Cut ``[lo, hi)`` out of every record; return whether anything was cut."""
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        j = max(i, bisect.bisect_left(self.starts, hi))
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
        """The records inside ``[lo, hi)`` when a copy over it fully overwrites earlier copies (``copied_bytes > 0`` of it,
        every record touching it wholly inside, together covering ``copied_bytes``: none became residual since), else ``None``."""
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


class IntervalSet:
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
