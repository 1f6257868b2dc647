"""The model's non-weight files (``config.json``, tokenizer files, ...): chosen (``docs/format.md`` §5), read and
checked by their pins."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from coldsnap_core._io import os_error, sha256_file
from coldsnap_core.errors import ModelIdentityMismatchError
from coldsnap_core.format.descriptor import CapsuleFile
from coldsnap_core.format.manifest import CAPSULE_FILE_NAME_RE

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".ckpt")
"""File name endings of weight files: never model files, and what makes a folder hold weights."""

WEIGHT_INDEX_SUFFIX = ".index.json"
"""A weight index (``model.safetensors.index.json``): it names the weight shards, so it goes with the weights."""

MAX_MODEL_FILE_BYTES = 64 << 20
"""The largest model file a capture copies (64 MiB); a larger one is left out with an INFO line."""


def holds_weight_files(folder: Path) -> bool:
    """Whether ``folder`` holds a weight file of any format at its top level (where ``_prepare_weights`` looks).

    Raises:
        FileAccessError: the folder cannot be listed.
    """
    try:
        with os.scandir(folder) as entries:
            return any(entry.name.endswith(WEIGHT_SUFFIXES) for entry in entries)
    except OSError as exc:
        raise os_error("cannot list the model folder", exc, folder) from exc


def read_model_files(folder: Path) -> list[tuple[CapsuleFile, bytes]]:
    """Every model file of ``folder`` (``docs/format.md`` §5) with its pin, sorted by name and read once (so what is
    written is what is pinned); those left out for their name or size are named in one INFO line.

    Raises:
        FileAccessError: the folder cannot be listed, or a file examined or read.
    """
    chosen, left_out = [], []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                weights = entry.name.endswith((*WEIGHT_SUFFIXES, WEIGHT_INDEX_SUFFIX))
                if entry.name.startswith(".") or weights or not entry.is_file():  # is_file follows links
                    continue
                if CAPSULE_FILE_NAME_RE.fullmatch(entry.name) is None:
                    left_out.append(f"{entry.name!r} (name outside [A-Za-z0-9._-]+)")
                elif entry.stat().st_size > MAX_MODEL_FILE_BYTES:
                    left_out.append(f"{entry.name} ({entry.stat().st_size} bytes, over {MAX_MODEL_FILE_BYTES})")
                else:
                    chosen.append(Path(entry.path))
    except OSError as exc:
        raise os_error("cannot list the model folder", exc, folder) from exc
    if left_out:
        logger.info("coldsnap: model files of %s left out of the artifact: %s", folder, ", ".join(sorted(left_out)))
    files = []
    for path in sorted(chosen, key=lambda p: p.name):
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise os_error("cannot read a model file", exc, path) from exc
        files.append((CapsuleFile(path.name, len(data), hashlib.sha256(data).hexdigest()), data))
    return files


def check_model_file(path: Path, pin: CapsuleFile, *, where: str) -> None:
    """The model file at ``path`` is a regular file (links followed) of ``pin``'s size and SHA-256 (``where`` pinned it).

    Raises:
        ModelIdentityMismatchError: nothing (or no regular file) at ``path``, or another size or SHA-256 (both named).
        FileAccessError: it cannot be examined or read.
    """
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise ModelIdentityMismatchError(f"model file {pin.name} pinned by {where} is missing", file=path) from None
    except OSError as exc:
        raise os_error("cannot examine a model file", exc, path) from exc
    if not os.path.isfile(path):
        raise ModelIdentityMismatchError(f"model file {pin.name} pinned by {where} is not a regular file", file=path)
    if st.st_size != pin.size_bytes:
        raise ModelIdentityMismatchError(
            f"model file {pin.name} is {st.st_size} bytes; {where} pins {pin.size_bytes} bytes", file=path
        )
    try:
        digest, _ = sha256_file(path)
    except OSError as exc:
        raise os_error("cannot read a model file", exc, path) from exc
    if digest != pin.sha256:
        raise ModelIdentityMismatchError(f"model file {pin.name} has SHA-256 {digest}; {where} pins {pin.sha256}", file=path)
