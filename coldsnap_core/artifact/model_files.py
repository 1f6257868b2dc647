"""The artifact's copy of the model's non-weight files, ``<artifact>/model/<name>`` (``docs/format.md`` §5, ``model_files``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

from coldsnap_core._io import os_error, remove_tree, replace_file_durably, write_file_durably
from coldsnap_core.artifact.capsules import (
    _artifact_lock,
    check_pinned_file,
    descriptor_lock_path,
    replace_dir_atomically,
    sweep_capsule_debris,
)
from coldsnap_core.errors import ArtifactError, ColdsnapError
from coldsnap_core.format.descriptor import DESCRIPTOR_FILENAME, MODEL_DIRNAME, ArtifactDescriptor, CapsuleFile
from coldsnap_core.identity.model_folder import read_model_files

logger = logging.getLogger(__name__)


def attach_model_files(artifact_dir: Path, folder: Path) -> tuple[CapsuleFile, ...]:
    """Copy the model files of ``folder`` into ``<artifact_dir>/model/`` and pin them in ``artifact.json``
    (``docs/format.md`` §5, "The model's non-weight files"); return the pins, sorted by name. MissingObjectError or
    ManifestError for ``artifact.json``; FileAccessError, InsufficientSpaceError or UnsafePathError for the files."""
    files = read_model_files(folder)
    pins = tuple(pin for pin, _ in files)
    path = artifact_dir / DESCRIPTOR_FILENAME
    with _artifact_lock(descriptor_lock_path(artifact_dir)):
        descriptor = ArtifactDescriptor.read(path)
        if descriptor.pinned_model_files == pins and _intact(artifact_dir, pins):
            return pins
        if descriptor.pinned_model_files not in ((), pins):
            changed = sorted({p.name for p in set(descriptor.pinned_model_files) ^ set(pins)})
            logger.warning(
                "coldsnap: %s: the model files %s differ from those artifact.json pinned; pinning those of %s",
                artifact_dir,
                ", ".join(changed),
                folder,
            )
        sweep_capsule_debris(artifact_dir, MODEL_DIRNAME)

        def fill(staging: Path) -> None:
            for pin, data in files:
                write_file_durably(staging / pin.name, data)

        if pins:
            replace_dir_atomically(artifact_dir / MODEL_DIRNAME, fill)
        else:
            remove_tree(artifact_dir / MODEL_DIRNAME)
        replace_file_durably(path, msgspec.structs.replace(descriptor, model_files=pins or msgspec.UNSET).dumps())
    return pins


def _intact(artifact_dir: Path, pins: tuple[CapsuleFile, ...]) -> bool:
    try:
        verify_model_files(artifact_dir, pins)
    except ColdsnapError:
        return False
    return True


def verify_model_files(artifact_dir: Path, pins: tuple[CapsuleFile, ...]) -> None:
    """``<artifact_dir>/model/`` holds exactly the pinned model files (hidden entries aside), each matching its pin.
    Raises as :func:`~coldsnap_core.artifact.capsules.check_pinned_file` for each pin, and ArtifactError (rule
    ``artifact``) when ``model/`` holds a file ``artifact.json`` does not pin."""
    model_dir = artifact_dir / MODEL_DIRNAME
    for pin in pins:
        check_pinned_file(model_dir / pin.name, pin)
    try:
        present = sorted(name for name in os.listdir(model_dir) if not name.startswith("."))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise os_error("cannot list the artifact's model folder", exc, model_dir) from exc
    unpinned = sorted(set(present) - {p.name for p in pins})
    if unpinned:
        raise ArtifactError(f"the artifact's model folder holds files artifact.json does not pin: {unpinned}", file=model_dir)
