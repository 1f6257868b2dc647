"""Choosing the copy backend for the device a model's weights live on."""

from __future__ import annotations

from typing import TYPE_CHECKING

from coldsnap_core.copy.base import CopyBackend
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch


def copy_backend_for(device: torch.device) -> CopyBackend:
    """The copy backend for allocations on ``device``: host memory on CPU, the CUDA backend on CUDA.

    Raises:
        ConfigurationError: the CUDA backend cannot run (cupy missing or no device; names why) or
            the device type has no backend.
    """
    if device.type == "cpu":
        return HostCopyBackend()
    if device.type == "cuda":
        import torch

        from coldsnap_core.copy.cuda import CudaCopyBackend, cuda_unavailable_reason

        reason = cuda_unavailable_reason()
        if reason is not None:
            raise ConfigurationError(f"weights are on {device}, but the CUDA copy backend cannot run: {reason}")
        return CudaCopyBackend(device=device.index if device.index is not None else torch.cuda.current_device())
    raise ConfigurationError(f"coldsnap has no copy backend for weights on {device}")
