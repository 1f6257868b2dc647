"""A seed's copy of vLLM's model-class inspection cache, placed before vLLM builds its configuration
(``docs/format.md`` §17.4): vLLM inspects the model's class when it builds its ``ModelConfig``, before any loader
runs (``vllm/model_executor/models/registry.py``, ``_LazyRegisteredModel.inspect_model_cls``), but after it calls
the general plugins' ``register()`` (``EngineArgs.__post_init__``), so :func:`place_early` runs there. It never
raises and never waits on a lock."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from coldsnap_core.artifact.capsules import read_descriptor_bytes
from coldsnap_core.artifact.derived_cache import SeedQualification
from coldsnap_core.artifact.overlay import OVERLAY_FILENAME, OVERLAYS_DIRNAME, OverlayDescriptor, artifact_key
from coldsnap_core.cache.records import read_private_record
from coldsnap_core.format.descriptor import CapsuleFile
from coldsnap_core.identity.target import collect_target, engine_version
from coldsnap_core.restore.derived_cache import MAX_REASON_CHARS, SeedPlacement, place_seed
from coldsnap_core.restore.overlay import find_overlay
from coldsnap_vllm import compat

logger = logging.getLogger(__name__)

EARLY_PREFIX = "vllm-cache/modelinfos/"
"""The members placed before vLLM builds its configuration: its model-class inspection cache."""
EARLY_FIELDS = ("engine", "engine_version", "torch_version", "torch_cuda_version")
"""The qualification's fields compared for them (``docs/format.md`` §17.4)."""

_candidates_log = logging.getLogger(f"{__name__}.candidates")
_candidates_log.addHandler(logging.NullHandler())
_candidates_log.propagate = False  # one line per process: each candidate's own outcome is summarized below

_lock = threading.Lock()
_done = False

_EARLY_FORMAT = "(pid=%(process)d) %(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
"""vLLM's text log format (``vllm/logger.py``), for the lines said before vLLM configured its logging."""


def _info(msg: str, *args: object) -> None:
    """One INFO line, now: through vLLM's logger once configured, else (``LLM(...)`` configures it after the plugins
    ran) to ``VLLM_LOGGING_STREAM`` in vLLM's format, unless ``VLLM_LOGGING_LEVEL`` is above INFO."""
    import vllm.envs as envs

    if not envs.VLLM_CONFIGURE_LOGGING or logging.getLogger("vllm").handlers:
        logger.info(msg, *args)
        return
    level = logging.getLevelName(str(envs.VLLM_LOGGING_LEVEL).upper())
    if isinstance(level, int) and level > logging.INFO:
        return
    handler = logging.StreamHandler(sys.stderr if envs.VLLM_LOGGING_STREAM == "ext://sys.stderr" else sys.stdout)
    handler.setFormatter(logging.Formatter(_EARLY_FORMAT, "%m-%d %H:%M:%S"))
    handler.handle(logger.makeRecord(logger.name, logging.INFO, __file__, 0, msg, args, None))


def place_early(environ: Mapping[str, str] | None = None) -> SeedPlacement | None:
    """Place the seed's model-class inspection cache, once per process: ``None`` when there was nothing to do (called
    before, no artifact, an export, seeds off, no such entries), ``used`` or ``skipped`` (one INFO line). Never raises."""
    global _done
    with _lock:
        if _done:
            return None
        _done = True
    try:
        return _place(os.environ if environ is None else environ)
    except Exception as exc:  # a seed never fails a start (docs/format.md §17)
        reason = f"{type(exc).__name__}: {exc}"[:MAX_REASON_CHARS]
        with contextlib.suppress(Exception):
            _info("coldsnap: vLLM's model-class inspection cache not placed from the seed: %r", reason)
        return SeedPlacement("skipped", reason)


def _place(environ: Mapping[str, str]) -> SeedPlacement | None:
    settings, _ = compat.resolve_settings(environ)
    if settings.artifact_dir is None or settings.export_model_payload or settings.derived_cache == "off":
        return None
    import vllm.envs as envs

    roots = {"vllm-cache": Path(envs.VLLM_CACHE_ROOT)}
    # this process's target on the CPU (no CUDA yet): only EARLY_FIELDS are compared
    target = collect_target("vllm", engine_version("vllm"))
    current = SeedQualification.for_target(target, model_config_sha256=None, compilation_sha256="", cpu_isa_flags=())
    skipped: tuple[Path, SeedPlacement] | None = None
    for folder, pins in _candidates(settings.artifact_dir, settings.state_root, settings.overlay != "off"):
        placement = place_seed(folder, pins, current, roots, log=_candidates_log, only=EARLY_PREFIX, fields=EARLY_FIELDS)
        if placement.status == "used":
            if placement.placed_files:  # all already there (another process of this start placed them): nothing done
                _info(
                    "coldsnap: %s: vLLM's model-class inspection cache placed from the seed: %d files written, %d already"
                    " present (register() places it in every start with COLDSNAP_ARTIFACT_DIR set, whatever its load"
                    " format; COLDSNAP_DERIVED_CACHE=off turns seeds off)",
                    folder,
                    placement.placed_files,
                    placement.present_files,
                )
            return placement
        if placement.status == "skipped" and skipped is None:
            skipped = (folder, placement)
    if skipped is not None:
        _info("coldsnap: %s: vLLM's model-class inspection cache not placed from the seed: %r", skipped[0], skipped[1].reason)
        return skipped[1]
    return None


def _candidates(artifact_dir: Path, state_root: Path, overlays: bool) -> Iterator[tuple[Path, tuple[CapsuleFile, ...]]]:
    """``(folder, pins)``: the artifact's portable capsules, then this node's valid overlays (``docs/format.md`` §15.3)."""
    # artifact.json within its 8 MiB cap (MAX_DESCRIPTOR_BYTES): this runs in every vLLM process, any load format
    descriptor, descriptor_sha256 = read_descriptor_bytes(artifact_dir)
    for entry in descriptor.workers:
        yield artifact_dir / entry.capsule, entry.capsule_files
    if not overlays:
        return
    base = state_root / OVERLAYS_DIRNAME / artifact_key(artifact_dir)
    for entry in descriptor.workers:
        for path in sorted(base.glob(f"*/{entry.worker.capsule_name}/{OVERLAY_FILENAME}")):
            try:
                target = read_private_record(path, OverlayDescriptor).target
            except Exception:  # an untrusted overlay is skipped here; the loader warns about it
                continue
            lookup = find_overlay(state_root, artifact_dir, entry, target, descriptor_sha256)
            if lookup.status == "valid" and lookup.descriptor is not None and lookup.descriptor.seed_files:
                yield lookup.path, lookup.descriptor.seed_files


__all__ = ["EARLY_FIELDS", "EARLY_PREFIX", "place_early"]
