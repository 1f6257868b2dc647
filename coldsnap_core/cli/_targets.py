"""Resolve a CLI ``ARTIFACT`` argument to the capsules it names, and which capsule a restore here would use."""

from __future__ import annotations

import os
from pathlib import Path

from coldsnap_core._io import os_error
from coldsnap_core.artifact.capsules import Capsule, read_capsule, read_descriptor, read_worker_capsule
from coldsnap_core.artifact.overlay import portable_descriptor_sha256
from coldsnap_core.cli._output import missing_dependency
from coldsnap_core.errors import ArtifactError, ColdsnapError, MissingObjectError
from coldsnap_core.format.descriptor import DESCRIPTOR_FILENAME, WORKERS_DIRNAME, ArtifactDescriptor
from coldsnap_core.format.manifest import NATIVE_MANIFEST_FILENAME
from coldsnap_core.identity.target import ENGINE_NONE, collect_target, engine_version
from coldsnap_core.restore.overlay import select_capsule


def _present(path: Path) -> bool:
    """Whether something is at ``path`` (``lstat``); a ``FileAccessError`` names it when it cannot be examined."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise os_error("cannot examine the path", exc, path) from exc
    return True


def artifact_folder(target: str) -> Path:
    """``target`` itself, or its folder when it names an ``artifact.json`` or ``native-manifest.json``."""
    path = Path(target)
    if path.name in (DESCRIPTOR_FILENAME, NATIVE_MANIFEST_FILENAME) and _present(path) and not path.is_dir():
        return path.parent
    return path


def resolve(target: str) -> tuple[ArtifactDescriptor | None, list[Capsule]]:
    """The descriptor (for an artifact folder, else ``None``) and the capsules of ``target``: an artifact folder or its
    ``artifact.json``, a capsule folder or a ``native-manifest.json`` (inside an artifact: read with its pins).

    Raises:
        MissingObjectError: nothing usable at ``target``.
        FileAccessError: ``target`` (or a document in it) cannot be examined: never reported as missing.
        ArtifactError: a capsule folder inside an artifact that ``artifact.json`` does not list.
        CapsulePinMismatchError, ManifestMismatchError, ManifestError: see ``read_worker_capsule``.
    """
    path = artifact_folder(target)
    if _present(path / DESCRIPTOR_FILENAME):
        descriptor = read_descriptor(path)
        return descriptor, [read_worker_capsule(path, entry) for entry in descriptor.workers]
    if _present(path / NATIVE_MANIFEST_FILENAME):
        artifact_dir = path.parent.parent
        if path.parent.name == WORKERS_DIRNAME and (artifact_dir / DESCRIPTOR_FILENAME).is_file():
            descriptor = read_descriptor(artifact_dir)
            entry = next((e for e in descriptor.workers if e.capsule == f"{WORKERS_DIRNAME}/{path.name}"), None)
            if entry is None:
                raise ArtifactError("capsule is not listed in artifact.json", file=path)
            return None, [read_worker_capsule(artifact_dir, entry)]
        return None, [read_capsule(path)]
    raise MissingObjectError(f"no {DESCRIPTOR_FILENAME} or {NATIVE_MANIFEST_FILENAME} here", file=path)


def restore_here(artifact_dir: Path, descriptor: ArtifactDescriptor, capsule: Capsule, state_root: Path) -> dict[str, object]:
    """Which capsule a restore of this worker by its installed capturing engine would use here, and why
    (``docs/format.md`` §15.4): ``capsule`` is ``portable``, ``qualified``, ``overlay`` or ``None`` (not qualified, or
    no torch here)."""
    recorded = capsule.target
    if recorded is None:
        return {"engine": None, "capsule": None, "overlay": None, "reason": "the capsule records no target.json"}
    unqualified = {"engine": recorded.engine, "capsule": None, "overlay": None}
    try:
        import torch  # only here: every other command starts without torch (about 2 s of import time)
    except ModuleNotFoundError as exc:
        return {**unqualified, "reason": f"no engine can run here: {missing_dependency(exc).detail}"}
    device = "cuda" if recorded.device_type == "cuda" and torch.cuda.is_available() else "cpu"
    version = engine_version(recorded.engine) if recorded.engine != ENGINE_NONE else None
    current = collect_target(recorded.engine, version, device=device)
    entry = next(e for e in descriptor.workers if e.worker == capsule.native.worker)
    try:
        selection = select_capsule(
            artifact_dir=artifact_dir,
            entry=entry,
            portable=capsule,
            current=current,
            state_root=state_root,
            descriptor_sha256=portable_descriptor_sha256(artifact_dir),
        )
    except ColdsnapError as exc:
        return {**unqualified, "reason": exc.detail}
    overlay = str(selection.overlay_path) if selection.overlay_path is not None else None
    return {"engine": recorded.engine, "capsule": selection.source, "overlay": overlay, "reason": selection.reason}
