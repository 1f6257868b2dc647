"""Resolve a CLI ``ARTIFACT`` argument to the capsules it names."""

from __future__ import annotations

from pathlib import Path

from coldsnap_core.artifact import Capsule, read_capsule, read_descriptor
from coldsnap_core.errors import MissingObjectError
from coldsnap_core.format.descriptor import DESCRIPTOR_FILENAME, ArtifactDescriptor
from coldsnap_core.format.manifest import NATIVE_MANIFEST_FILENAME


def resolve(target: str) -> tuple[ArtifactDescriptor | None, list[Capsule]]:
    """``target`` may be an artifact folder (``artifact.json`` inside), a capsule folder, or a
    ``native-manifest.json`` file. Returns the descriptor (if any) and the capsules, in order.

    Raises:
        MissingObjectError: nothing usable at ``target``.
    """
    path = Path(target)
    if path.is_file() and path.name == NATIVE_MANIFEST_FILENAME:
        path = path.parent
    if (path / DESCRIPTOR_FILENAME).is_file():
        descriptor = read_descriptor(path)
        return descriptor, [read_capsule(path / entry.capsule) for entry in descriptor.workers]
    if (path / NATIVE_MANIFEST_FILENAME).is_file():
        return None, [read_capsule(path)]
    raise MissingObjectError(f"no {DESCRIPTOR_FILENAME} or {NATIVE_MANIFEST_FILENAME} here", file=path)
