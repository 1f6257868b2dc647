"""One observed checkpoint load (:class:`LoadSession`): the prepared weight sources, the iterator boundary, the identity."""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

from coldsnap_core.capture.checkpoint_sources import CheckpointSources, dense
from coldsnap_core.capture.observer import WriteObserver
from coldsnap_core.errors import ObserverError
from coldsnap_core.format.manifest import ModelIdentity
from coldsnap_core.format.safetensors_header import TensorLocation, read_header
from coldsnap_core.identity.checkpoint_records import CheckpointRecords
from coldsnap_core.identity.model_identity import identify_checkpoint

_T = TypeVar("_T")


@dataclass
class PreparedWeights:
    """One ``_prepare_weights`` result of an engine's default loader: ``(folder, files, use_safetensors)``."""

    model_or_path: str
    folder: Path
    files: list[Path]
    use_safetensors: bool


def _stored_location(
    tensor: torch.Tensor, candidates: list[tuple[str, TensorLocation]], seen: int
) -> tuple[str, TensorLocation] | None:
    """Which of the files that store a tensor's name holds this yielded ``tensor``'s bytes (``None``: none): the
    ``seen``-th candidate when its bytes are the tensor's, else the first whose bytes are (a name stored in several
    files is yielded once per file in the engine's own order, vLLM ``model_executor/model_loader/weight_utils.py``)."""
    if not dense(tensor) or not tensor.is_contiguous():
        return None
    data = tensor.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
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
    """One observed checkpoint load: the prepared weight sources, in order, and the checkpoint tensors yielded."""

    sources: CheckpointSources = field(default_factory=CheckpointSources)
    prepared: list[PreparedWeights] = field(default_factory=list)

    def observe(
        self, prefix: str, iterator: Iterator[tuple[str, torch.Tensor]]
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """Register every yielded tensor with its header location (in the last prepared source, names without
        ``prefix``), then pass it on; the iterator's ``next`` and ``close`` run unobserved (:meth:`_unobserved`)."""
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
                checkpoint_file, location = found if found is not None else (None, None)
                self.sources.register(tensor, location, checkpoint_file)
                yield name, tensor
        finally:
            # Closed here, not by garbage collection under the observer: an iterator holding a dispatch mode of its own
            # pops the innermost mode on exit, which must be its own (at interpreter exit, garbage collection closes it).
            close = getattr(iterator, "close", None)
            if close is not None and not sys.is_finalizing():
                self._unobserved(close)

    def _unobserved(self, call: Callable[..., _T], *args: object) -> _T:
        """``call(*args)`` with this session's :class:`WriteObserver` set aside when it is the innermost dispatch mode
        (producing a checkpoint tensor writes no model allocation; ``docs/format.md`` §6.1)."""
        mode = _get_current_dispatch_mode()
        if isinstance(mode, WriteObserver) and mode.sources is self.sources:
            with _pop_mode_temporarily():
                return call(*args)
        return call(*args)

    def primary(self, model_or_path: str) -> PreparedWeights | None:
        """The prepared source of the model itself (``model_or_path``), else the first one, else ``None``."""
        found = next((p for p in self.prepared if p.model_or_path == str(model_or_path)), None)
        return found if found is not None else (self.prepared[0] if self.prepared else None)

    def identify(
        self,
        source: str,
        *,
        revision: str | None,
        config_sha256: str | None,
        state_root: Path,
        config_json: str | None = None,
    ) -> ModelIdentity:
        """The model identity of this load (:func:`identify_checkpoint` of the :meth:`primary` source's files).

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
            config_json=config_json,
        )

    @staticmethod
    def _header_index(prepared: PreparedWeights) -> dict[str, list[tuple[str, TensorLocation]]]:
        """Header name -> ``(relative file name, location)`` in each prepared safetensors file storing it, in order."""
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
