"""Helpers for the observer tests: a small real safetensors checkpoint read the way vLLM reads one.

The checkpoint's tensors are deterministic (``arange``-based, bf16), so captured packs have golden
digests. :func:`open_checkpoint` opens it with ``safetensors.safe_open`` (the lazy strategy of
vLLM's ``safetensors_weights_iterator``, ``weight_utils.py``) and registers every tensor at the
iterator boundary exactly as the coldsnap loader does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from coldsnap_core.capture.checkpoint_sources import CheckpointSources
from coldsnap_core.format.safetensors_header import read_header

CHECKPOINT_NAME = "model.safetensors"


def pattern(shape: tuple[int, ...], start: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Deterministic values ``start, start + 1, ...`` (exact in bf16 up to 256), wrapped at 200."""
    count = 1
    for n in shape:
        count *= n
    return ((torch.arange(count, dtype=torch.float32) + start) % 200 - 100).reshape(shape).to(dtype)


def write_checkpoint(folder: Path) -> Path:
    """A checkpoint with the shapes of a tiny Llama layer: q/k/v, o, gate/up, down, norm, embed."""
    tensors = {
        "embed.weight": pattern((10, 8), 0),
        "q.weight": pattern((8, 8), 1),
        "k.weight": pattern((4, 8), 2),
        "v.weight": pattern((4, 8), 3),
        "o.weight": pattern((8, 8), 4),
        "down.weight": pattern((8, 16), 5),
        "norm.weight": pattern((8,), 6),
    }
    path = folder / CHECKPOINT_NAME
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


@contextlib.contextmanager
def open_checkpoint(path: Path) -> Iterator[tuple[CheckpointSources, dict[str, torch.Tensor]]]:
    """Open ``path`` lazily and register every tensor as a checkpoint source."""
    sources = CheckpointSources()
    header = read_header(path)
    with safe_open(str(path), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        for name, tensor in tensors.items():
            assert sources.register(tensor, header[name], path.name)
        yield sources, tensors


def file_bytes(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


class WrapperTensor(torch.Tensor):
    """A wrapper tensor subclass (``torch.Tensor._make_wrapper_subclass``, as DTensor and torchao's
    quantized tensors are): its storage object has no data behind it (``data_ptr()`` raises), and
    its ``__torch_dispatch__`` runs each operator on the wrapped ``inner`` tensor, below any dispatch
    mode (``detach`` keeps the wrapper, so it can be an ``nn.Parameter``)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return cls(args[0].inner.detach())
        unwrap = lambda value: value.inner if isinstance(value, WrapperTensor) else value  # noqa: E731
        inner_args = [unwrap(a) for a in args]
        result = func(*inner_args, **{k: unwrap(v) for k, v in (kwargs or {}).items()})
        return args[0] if inner_args and result is inner_args[0] else result  # in place: the wrapper itself


class DeviceTensor(torch.Tensor):
    """A checkpoint tensor as an iterator that loads onto the GPU yields it, held in host memory: ``device``
    says ``cuda:0`` and ``numpy()`` is refused with CUDA's own message, while ``cpu()`` and ``to("cpu")``
    give a host copy (the device-to-host copy a real CUDA tensor makes). Its storage is real (it registers
    as a checkpoint source and ``copy_`` reads it); views and ``detach`` keep the subclass
    (``torch.Tensor.__torch_function__``)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:  # a new method-wrapper per access: compared, not identical
            return torch.device("cuda", 0)
        if func is torch.Tensor.numpy:
            raise TypeError(
                "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first."
            )
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and [str(a) for a in args[1:]] == ["cpu"] and not kwargs):
            with torch._C.DisableTorchFunctionSubclass():
                return args[0].clone()
        return super().__torch_function__(func, types, args, kwargs)
