"""The current worker's target identity, and whether a capsule's residual qualifies for replay on it.

A residual blob holds bytes computed by the runtime that captured it (rotary caches, attention
scales, padding: ``docs/format.md`` §3), so a capsule records its target in ``target.json``
(:class:`~coldsnap_core.format.target.TargetIdentity`) and restore replays it only on a target whose
qualifying fields are equal (§15). The pack is never judged here: model bytes are checkpoint bytes,
target independent.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from coldsnap_core._io import os_error
from coldsnap_core._version import __version__
from coldsnap_core.errors import TargetMismatchError
from coldsnap_core.format.target import QUALIFYING_FIELDS, TargetIdentity, describe_differences

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ENGINE_NONE = "none"
"""The engine name of a capture or restore without an engine (tests, benchmarks, the Python API)."""

NVIDIA_DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
"""Written by the NVIDIA kernel module: ``NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15 ...``."""

_DRIVER_RE = re.compile(r"Kernel Module(?: for [A-Za-z0-9_]+)?\s+([0-9][0-9.]*)")


def coldsnap_version() -> str:
    """coldsnap's release version (:data:`coldsnap_core._version.__version__`, which the installed
    distribution's metadata also says; read from the module rather than the metadata, whose first read
    in a process scans ``sys.path`` and parses a mail header: 1-2 ms of every restore)."""
    return __version__


@functools.cache
def engine_version(engine: str) -> str | None:
    """The installed version of the engine's distribution (``importlib.metadata.version``: ``vllm``
    ``0.32.0+cpu``, ``sglang`` ``0.5.23``), read without importing the engine; ``None`` when no
    distribution of that name is installed. The local version label (``+cpu``) is kept: a CPU and a
    CUDA build of one release are different runtimes.

    Read once per process (a metadata scan of ``sys.path`` costs about 1 ms per call, and a restore
    asks several times): an engine upgraded on disk while a process runs does not change the code that
    process runs."""
    try:
        return importlib.metadata.version(engine)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def nvidia_driver_version(version_file: Path = NVIDIA_DRIVER_VERSION_FILE) -> str | None:
    """The installed NVIDIA kernel driver's version (``550.54.15``), read from ``version_file``;
    ``None`` when there is no NVIDIA driver (no file) or the file names no version.

    Raises:
        FileAccessError, NotRegularFileError: the file exists (or may) but cannot be read (``EACCES``,
            ``EIO``; a folder there): "no driver" would change the target identity, so a node would fall back and capture
            an overlay for a target that does not exist. Not cached (``functools.cache`` keeps no
            exception), so a later call reads the file again.
    """
    try:
        text = version_file.read_text(encoding="utf-8", errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise os_error("the NVIDIA driver version cannot be read", exc, version_file) from exc
    match = _DRIVER_RE.search(text)
    return match.group(1) if match else None


def collect_target(
    engine: str = ENGINE_NONE, engine_version: str | None = None, *, device: torch.device | str | None = None
) -> TargetIdentity:
    """The current worker's target identity.

    Args:
        engine: ``vllm``, ``sglang``, or :data:`ENGINE_NONE`.
        engine_version: the engine's version string (``vllm.__version__``, ``sglang.__version__``).
        device: the device the worker's weights live on (default: CPU). For a CUDA device, the
            accelerator model is ``torch.cuda.get_device_name`` of that device (its index, else the
            current one) and the count ``torch.cuda.device_count()``.

    Returns:
        The identity; the driver version is that of the NVIDIA kernel module when one is loaded
        (:func:`nvidia_driver_version`), whatever the device.
    """
    import torch  # here, not at module top: the CLI's commands import this module and most never need torch

    device = torch.device(device if device is not None else "cpu")
    model: str | None = None
    count = 0
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        model = torch.cuda.get_device_name(index)
        count = torch.cuda.device_count()
    return TargetIdentity(
        engine=engine,
        engine_version=engine_version,
        coldsnap_version=coldsnap_version(),
        torch_version=str(torch.__version__),
        torch_cuda_version=torch.version.cuda,
        device_type=device.type,
        accelerator_model=model,
        accelerator_count=count,
        nvidia_driver_version=nvidia_driver_version(),
        host=socket.gethostname(),
    )


def _engine_text(target: TargetIdentity) -> str:
    if target.engine == ENGINE_NONE:
        return "no engine (coldsnap_core directly)"
    return f"{target.engine} {target.engine_version or '(version unknown)'}"


def mismatch_detail(recorded: TargetIdentity, current: TargetIdentity) -> str | None:
    """Why a residual captured on ``recorded`` is not replayed on ``current``, or ``None`` if it qualifies.

    Another engine is named first, as such ("captured by vllm 0.32.0; this engine is sglang
    0.5.23"): its capsule has another allocation layout too, and the engine is the reason.
    """
    differences = recorded.differences(current)
    if not differences:
        return None
    if recorded.engine != current.engine:
        rest = tuple(d for d in differences if d[0] not in ("engine", "engine_version"))
        return (
            f"the capsule was captured by {_engine_text(recorded)}; this engine is {_engine_text(current)}: one engine's"
            " capsule (residual and manifests) is never replayed by another; capture an artifact with this engine"
            + (f" (also differs: {describe_differences(rest)})" if rest else "")
        )
    return (
        f"the capsule's residual was captured on another target ({describe_differences(differences)}); its buffers"
        " were computed by that runtime and are not replayed here"
    )


def check_qualified(recorded: TargetIdentity, current: TargetIdentity, *, file: str | None = None) -> None:
    """A capsule's recorded target must qualify for the current one (every field of
    :data:`~coldsnap_core.format.target.QUALIFYING_FIELDS` equal).

    Raises:
        TargetMismatchError: names each differing field with its captured and current value, the
            capturing and the current engine first when they differ.
    """
    detail = mismatch_detail(recorded, current)
    if detail is not None:
        raise TargetMismatchError(detail, differences=recorded.differences(current), file=file)


__all__ = [
    "ENGINE_NONE",
    "QUALIFYING_FIELDS",
    "check_qualified",
    "collect_target",
    "engine_version",
    "mismatch_detail",
    "nvidia_driver_version",
]
