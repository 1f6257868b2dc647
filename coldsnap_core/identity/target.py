"""The current worker's target identity, and whether a capsule's residual qualifies for replay on it (``docs/format.md`` §15)."""

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
from coldsnap_core.format.target import TargetIdentity, describe_differences

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ENGINE_NONE = "none"
"""The engine name of a capture or restore without an engine (tests, benchmarks, the Python API)."""

NVIDIA_DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
"""Written by the NVIDIA kernel module: ``NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15 ...``."""

_DRIVER_RE = re.compile(r"Kernel Module(?: for [A-Za-z0-9_]+)?\s+([0-9][0-9.]*)")


def coldsnap_version() -> str:
    """coldsnap's release version (:data:`coldsnap_core._version.__version__`, not the slower distribution metadata)."""
    return __version__


@functools.cache
def engine_version(engine: str) -> str | None:
    """The installed version of the engine's distribution (``0.32.0+cpu``: a CPU and a CUDA build are different
    runtimes), read once per process without importing the engine; ``None`` when not installed."""
    try:
        return importlib.metadata.version(engine)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def nvidia_driver_version(version_file: Path = NVIDIA_DRIVER_VERSION_FILE) -> str | None:
    """The installed NVIDIA kernel driver's version (``550.54.15``); ``None`` when there is no file or it names none.

    Raises:
        FileAccessError, NotRegularFileError: the file cannot be read (not cached: a later call reads it again).
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
    """The current worker's target identity (``docs/format.md`` §15.1) on ``device`` (default CPU; CUDA: the current one)."""
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
    """Why a residual captured on ``recorded`` is not replayed on ``current`` (another engine named first), or ``None``."""
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
