"""The pinned model identity recorded for the recovery-loader fallback."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from coldsnap_core._io import sha256_file
from coldsnap_core.format.manifest import CheckpointFile, ModelIdentity


def identify_checkpoint(
    files: Iterable[Path], *, source: str, revision: str | None = None, root: Path | None = None
) -> ModelIdentity:
    """Hash every checkpoint file (SHA-256, one pass each) into a :class:`ModelIdentity`.

    Args:
        files: the checkpoint files.
        source: the Hugging Face repository id or the local folder the model was loaded from.
        revision: the repository revision, if any.
        root: names are recorded relative to this folder (default: each file's own folder).
    """
    entries = []
    for path in files:
        path = Path(path)
        digest, size = sha256_file(path)
        name = str(path.relative_to(root)) if root is not None else path.name
        entries.append(CheckpointFile(name, size, digest))
    return ModelIdentity(source, revision, tuple(sorted(entries, key=lambda c: c.name)))
