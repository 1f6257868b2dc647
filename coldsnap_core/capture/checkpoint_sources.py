"""The source side of the write observer: the checkpoint tensors the engine's iterator yielded (``docs/format.md`` §6.1),
keyed by storage through a weak reference (a freed source whose address is reused is never taken for checkpoint bytes)."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from coldsnap_core.copy.torch_allocations import dtype_name
from coldsnap_core.format.safetensors_header import TensorLocation


@dataclass(frozen=True, slots=True)
class SourceSpan:
    """A checkpoint tensor as the engine's iterator yielded it (``checkpoint_file`` relative to the checkpoint folder)."""

    checkpoint_file: str
    tensor_name: str
    file_offset_bytes: int
    size_bytes: int
    dtype: torch.dtype
    storage_offset_bytes: int


@dataclass(slots=True)
class _StorageEntry:
    ref: weakref.ref
    spans: list[SourceSpan]


def storage_extent_bytes(tensor: torch.Tensor) -> tuple[int, int]:
    """``[lo, hi)`` byte offsets within its storage that ``tensor`` can touch (non-negative strides)."""
    start = int(tensor.storage_offset()) * tensor.element_size()
    if tensor.numel() == 0:
        return start, start
    last = sum((int(n) - 1) * int(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + (last + 1) * tensor.element_size()


def dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is strided with sizes and strides (not sparse, mkldnn, jagged or a strided nested tensor)."""
    return tensor.layout == torch.strided and not tensor.is_nested


def data_address(tensor: torch.Tensor) -> tuple[torch.UntypedStorage, int] | None:
    """``tensor``'s storage and its first byte's address, or ``None`` when it has no data (a wrapper subclass made with
    ``torch.Tensor._make_wrapper_subclass``, whose ``data_ptr()`` raises ``RuntimeError``)."""
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
        """Register a yielded checkpoint tensor: whether ``location`` describes it exactly (dtype, shape, size; contiguous)."""
        if (
            location is None
            or checkpoint_file is None
            or not dense(tensor)
            or not tensor.is_contiguous()
            or dtype_name(tensor.dtype) != location.dtype
            or tuple(tensor.shape) != tuple(location.shape)
            or tensor.numel() * tensor.element_size() != location.size_bytes
            or (addressed := data_address(tensor)) is None
        ):
            self.unknown.append(location.name if location is not None else "?")
            return False
        storage, base = addressed
        start, _ = storage_extent_bytes(tensor)
        span = SourceSpan(checkpoint_file, location.name, location.offset_bytes, location.size_bytes, tensor.dtype, start)
        with self._lock:
            entry = self._entries.get(base)
            if entry is not None and entry.ref() is storage:
                entry.spans = _outside(entry.spans, start, start + span.size_bytes)
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
        addressed = data_address(tensor)
        if addressed is None:
            return None
        storage, base = addressed
        entry = self._entries.get(base)
        if entry is None or entry.ref() is not storage:
            return None
        return entry

    def find(self, tensor: torch.Tensor) -> tuple[SourceSpan, int] | None:
        """The registered source all of ``tensor`` lies in, with the byte offset of its first element there, or ``None``."""
        if not dense(tensor):
            return None
        with self._lock:
            entry = self._entry(tensor)
            if entry is None:
                return None
            lo, hi = storage_extent_bytes(tensor)
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
            lo, hi = storage_extent_bytes(tensor) if dense(tensor) else (0, tensor.untyped_storage().nbytes())
            entry.spans = _outside(entry.spans, lo, hi)


def _outside(spans: list[SourceSpan], lo: int, hi: int) -> list[SourceSpan]:
    """The spans that share no byte with the storage bytes ``[lo, hi)``."""
    return [s for s in spans if s.storage_offset_bytes + s.size_bytes <= lo or hi <= s.storage_offset_bytes]
