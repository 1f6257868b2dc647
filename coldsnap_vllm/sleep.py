"""The ``coldsnap`` sleep-mode backend: a level-1 sleep that keeps no host copy of the weights. Where vLLM's
``CuMemBackend`` copies every "weights" segment to pinned host memory and back, ``suspend(1)`` captures them and
releases them with no backup, and ``resume`` maps new memory at the same addresses and hydrates them from pack +
residual. Level 2 keeps vLLM's semantics. vLLM builds the backend with no arguments, so the model comes from
:mod:`coldsnap_vllm.state` (``docs/format.md`` §6.2; ``vllm/device_allocator/sleep_mode_backend.py``, ``cumem.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from coldsnap_core.artifact.sleep_capsules import SleepCapsuleClaim, sleep_capsule_dir, sleep_dir, sweep_sleep_capsules
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.sleep import NativeCapture, ReferenceDigests, capture_native
from coldsnap_core.copy.base import CopyBackend
from coldsnap_core.errors import ColdsnapError, ConfigurationError, WakeError
from coldsnap_core.format.allocation import LiveAllocation
from coldsnap_core.format.manifest import NATIVE_MANIFEST_FILENAME
from coldsnap_core.restore.hydrate import HydrationReport, hydrate
from coldsnap_core.settings import LOCK_TIMEOUT_SECONDS
from coldsnap_vllm.cumem import WEIGHTS_TAG, WeightsSegment, live_allocations, map_writes, native_allocation_map, weights_segments
from coldsnap_vllm.state import WorkerLoadState
from coldsnap_vllm.state import current as published_state

logger = logging.getLogger(__name__)

BACKEND_NAME = "coldsnap"
"""The name for ``--sleep-mode-backend``."""

OFFLOAD_TAGS: tuple[str, ...] = ("runtime", "cudagraph")
"""Tags vLLM backs up to host memory at every sleep level (``CuMemBackend.suspend``)."""

SleepState = Literal["RUNNING", "SUSPENDED", "RESUMING"]

try:  # feature-detect: vLLM >= 0.32 has pluggable sleep backends (PR #44074)
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackend as _SleepModeBackendBase
except ImportError:  # vLLM absent or without the factory: the class still works on its own
    _SleepModeBackendBase = object  # type: ignore[assignment,misc]

_Weights = Literal["resident", "captured", "discarded", "needs_hydration"]


@dataclass(frozen=True, slots=True)
class SleepCapture(NativeCapture):
    """What a level-1 sleep captured (:class:`~coldsnap_core.capture.sleep.NativeCapture`) and the weights segments to refill."""

    segments: tuple[WeightsSegment, ...] = ()


def capture_for_sleep(
    state: WorkerLoadState,
    segments: Sequence[WeightsSegment],
    backend: CopyBackend,
    references: ReferenceDigests,
    *,
    capsule_dir: Path | None = None,
) -> SleepCapture:
    """Capture the live weights segments (sorted by address) into pack + sleep capsule (default: an unclaimed
    :func:`~coldsnap_core.artifact.sleep_capsules.sleep_capsule_dir`); nothing is released. Raises as
    :func:`~coldsnap_core.capture.sleep.capture_native`, and ``ObserverError`` for writes that straddle or overlap."""
    captured = capture_native(
        native_allocation_map(segments),
        live_allocations(segments),
        backend,
        map_writes(state.writes, segments).ranges,
        references,
        worker=state.worker,
        model=state.model,
        cache=PayloadCache(state.state_root, lock_timeout_seconds=state.lock_timeout_s),
        capsule_dir=capsule_dir or sleep_capsule_dir(state.state_root, state.worker),
        log=logger,
    )
    fields = {f.name: getattr(captured, f.name) for f in dataclasses.fields(captured)}
    return SleepCapture(**fields, segments=tuple(segments))


class ColdsnapSleepBackend(_SleepModeBackendBase):  # type: ignore[misc,valid-type]
    """vLLM ``SleepModeBackend`` ``coldsnap``; arguments for tests and tools; ``verify_extents`` ``None``: the loader's."""

    def __init__(
        self,
        *,
        allocator: Any = None,
        backend_factory: Callable[[int], CopyBackend] | None = None,
        load_state: Callable[[], WorkerLoadState | None] | None = None,
        verify_extents: bool | None = None,
    ) -> None:
        if _SleepModeBackendBase is not object:
            super().__init__()
        self._allocator = allocator
        self._backend_factory = backend_factory
        self._load_state = load_state or published_state
        self.verify_extents = verify_extents
        self._wake_verify_extents = bool(verify_extents)
        self._wake_lock_timeout_s = LOCK_TIMEOUT_SECONDS
        self._lock = threading.RLock()
        self._state: SleepState = "RUNNING"
        self._weights: _Weights = "resident"
        self._capture: SleepCapture | None = None
        self._references: ReferenceDigests | None = None
        self._copy_backend: CopyBackend | None = None
        self._needs_hydration: set[int] = set()
        self._claim: SleepCapsuleClaim | None = None
        self._finalizer: weakref.finalize | None = None
        self.last_report: HydrationReport | None = None

    @classmethod
    def is_supported(cls) -> bool:
        """Supported where vLLM's CuMem allocator is (CUDA and ROCm builds with the C extension)."""
        try:
            from vllm.device_allocator import cumem
        except ImportError:
            return False
        return bool(cumem.cumem_available)

    @classmethod
    def preserves_communicators(cls) -> bool:
        """Only memory is released; communicators stay as with vLLM's ``cumem`` backend."""
        return True

    def state(self) -> SleepState:
        """``RUNNING``, ``SUSPENDED`` (also after a failed wake) or ``RESUMING``."""
        return self._state

    @property
    def capture(self) -> SleepCapture | None:
        """The last level-1 capture (its capsule is valid while the weights are asleep)."""
        return self._capture

    @property
    def needs_hydration(self) -> frozenset[int]:
        """Addresses of weights segments a wake must still fill."""
        return frozenset(self._needs_hydration)

    def suspend(self, level: int = 1) -> None:
        """Release GPU state: level 1 captures first (nothing is released if that fails), level 2 discards as vLLM does.

        Raises:
            ConfigurationError: ``level`` is not 1 or 2, the coldsnap loader published no state in this process, or
                the copy backend cannot run.
            ObserverError / CacheError / ManifestError: the capture failed (the model stays awake).
        """
        if level not in (1, 2):
            raise ConfigurationError(f"sleep level {level} is not supported by the coldsnap backend (1 or 2)")
        with self._lock:
            allocator = self._get_allocator()
            if self._weights == "resident":
                if level == 1:
                    self._capture_weights(allocator)
                    self._weights = "captured"
                else:
                    self._weights = "discarded"
            elif self._weights == "needs_hydration":
                logger.info("coldsnap: sleeping again after a failed wake; the capsule from the last sleep stays valid")
                self._weights = "captured"
            elif level == 2 and self._weights == "captured":
                self._weights = "discarded"
            else:
                logger.info("coldsnap: the weights are already asleep; releasing whatever else is awake")
            self._state = "SUSPENDED"
            allocator.sleep(offload_tags=OFFLOAD_TAGS)

    def resume(self, tags: list[str] | None = None) -> None:
        """Wake ``tags`` (``None``: everything); ``RUNNING`` only once every weights segment is filled.

        Raises:
            WakeError: the allocator could not map a segment, a segment changed, or hydration failed (naming the
                cause's rule, file, allocation and offset); the state stays ``SUSPENDED``, the next wake starts over.
        """
        with self._lock:
            allocator = self._get_allocator()
            wake_weights = tags is None or WEIGHTS_TAG in tags
            if wake_weights and self._weights in ("captured", "needs_hydration"):
                self._wake_and_hydrate(allocator, tags)
            elif self._any_asleep(allocator):
                self._state = "RESUMING"
                try:
                    allocator.wake_up(tags)
                except BaseException:
                    self._state = "SUSPENDED"
                    raise
                if wake_weights and self._weights == "discarded":
                    self._weights = "resident"
            else:
                logger.info("coldsnap: nothing is asleep; wake ignored")
            self._state = "RUNNING" if self._weights == "resident" and not self._any_asleep(allocator) else "SUSPENDED"

    def discard(self, tags: tuple[str, ...]) -> None:
        """Discard tagged allocations without backup (vLLM ``discard``); the next wake of the weights is a re-map."""
        with self._lock:
            allocator = self._get_allocator()
            if WEIGHTS_TAG in tags and self._weights != "discarded":
                self._weights = "discarded"
                self._needs_hydration.clear()
            allocator.discard(tags)
            self._state = "SUSPENDED"

    def close(self) -> None:
        """Remove this process's sleep capsule and its lock, and free the copy backend's pinned buffers."""
        with self._lock:
            self._release_claim()
            close = getattr(self._copy_backend, "close", None)
            if close is not None:
                close()
            self._copy_backend = None

    def _release_claim(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # SleepCapsuleClaim.release: the capsule, then its lock
            self._finalizer = None
        self._claim = None

    def _get_allocator(self) -> Any:
        if self._allocator is None:
            from vllm.device_allocator import get_mem_allocator_instance

            self._allocator = get_mem_allocator_instance()
        return self._allocator

    @staticmethod
    def _any_asleep(allocator: Any) -> bool:
        return any(d.is_asleep for d in allocator.pointer_to_data.values())

    def _copy(self, device: int) -> CopyBackend:
        if self._copy_backend is None:
            if self._backend_factory is not None:
                self._copy_backend = self._backend_factory(device)
            else:
                from coldsnap_core.copy.cuda import CudaCopyBackend, CupyDeviceOps

                self._copy_backend = CudaCopyBackend(ops=CupyDeviceOps(device))
        return self._copy_backend

    def _capture_weights(self, allocator: Any) -> None:
        state = self._load_state()
        if state is None:
            raise ConfigurationError(
                "the coldsnap sleep backend needs the coldsnap loader's state in this worker process:"
                " load the model with --load-format coldsnap (or use --sleep-mode-backend cumem)"
            )
        segments = weights_segments(allocator.pointer_to_data)
        if not segments:
            raise ConfigurationError("the allocator has no 'weights' segments; was the model loaded with --enable-sleep-mode?")
        asleep = [s for s in segments if allocator.pointer_to_data[s.address].is_asleep]
        if asleep:
            raise ConfigurationError(
                f"weights segment at {asleep[0].address:#x} is already released; cannot capture",
                allocation=asleep[0].index,
            )
        backend = self._copy(segments[0].device)
        self._wake_verify_extents = state.verify_extents if self.verify_extents is None else self.verify_extents
        self._wake_lock_timeout_s = state.lock_timeout_s
        if self._references is None or self._references.state is not state:
            self._references = ReferenceDigests(state)
        claim = self._claim
        if claim is not None and (claim.folder != sleep_dir(state.state_root) or claim.capsule_name != state.worker.capsule_name):
            self._release_claim()  # a reloaded model with another identity or state root: drop the old capsule
            claim = None
        if claim is None:
            # unique to this process instance and locked while in use (coldsnap_core.artifact.sleep_capsules)
            claim = SleepCapsuleClaim(state.state_root, state.worker.capsule_name)
            self._claim = claim
            self._finalizer = weakref.finalize(self, claim.release)
        try:  # every sleep capture is a writer of sleep/: the capsules of killed engines go now
            sweep_sleep_capsules(state.state_root)
        except ColdsnapError as exc:
            logger.warning("coldsnap: cannot remove stale sleep capsules: %s", exc)
        capture = capture_for_sleep(state, segments, backend, self._references, capsule_dir=claim.path)
        self._capture = capture
        prepare = getattr(backend, "prepare", None)
        if prepare is not None:  # staging buffers now, not on the wake's critical path
            prepare()

    def _wake_and_hydrate(self, allocator: Any, tags: list[str] | None) -> None:
        capture = self._capture
        assert capture is not None
        claim = self._claim
        if claim is None or not claim.held or capture.capsule_dir != claim.path:
            raise WakeError("this backend holds no sleep capsule of its own; cannot hydrate", file=capture.capsule_dir)
        self._state = "RESUMING"
        self._needs_hydration |= {
            address
            for address, data in allocator.pointer_to_data.items()
            if data.tag == WEIGHTS_TAG and data.is_asleep and data.cpu_backup_tensor is None
        }
        self._weights = "needs_hydration"
        try:
            try:
                allocator.wake_up(tags)
            except Exception as exc:
                raise WakeError(f"the allocator could not map the weights segments again: {exc}") from exc
            allocations = self._check_segments(allocator, capture)
            self.last_report = hydrate(
                capture.manifest,
                blob_path=capture.blob_path,
                cache=PayloadCache(capture.state_root, lock_timeout_seconds=self._wake_lock_timeout_s),
                allocations=allocations,
                backend=self._copy(capture.segments[0].device),
                verify_extents=self._wake_verify_extents,
                manifest_file=str(capture.capsule_dir / NATIVE_MANIFEST_FILENAME),
            )
        except BaseException as exc:
            self._state = "SUSPENDED"
            if isinstance(exc, WakeError):
                raise
            if isinstance(exc, ColdsnapError):
                raise WakeError(
                    f"hydrating the weights failed, {len(self._needs_hydration)} segments still need hydration"
                    f" (the next wake starts over): rule {exc.rule} failed: {exc.detail}",
                    file=exc.file,
                    allocation=exc.allocation,
                    offset_bytes=exc.offset_bytes,
                ) from exc
            if isinstance(exc, Exception):
                raise WakeError(f"hydrating the weights failed (the next wake starts over): {exc!r}") from exc
            raise
        self._needs_hydration.clear()
        self._weights = "resident"

    def _check_segments(self, allocator: Any, capture: SleepCapture) -> Sequence[LiveAllocation]:
        """Every captured segment is mapped again at its address and size, and every asleep one was captured."""
        captured = {s.address for s in capture.segments}
        for address in sorted(self._needs_hydration):
            if address not in captured:
                raise WakeError(f"weights segment at {address:#x} was not captured at the last sleep; cannot hydrate it")
        for segment in capture.segments:
            data = allocator.pointer_to_data.get(segment.address)
            if data is None or data.tag != WEIGHTS_TAG:
                raise WakeError(f"captured weights segment at {segment.address:#x} is gone", allocation=segment.index)
            if data.is_asleep:
                raise WakeError(
                    f"weights segment at {segment.address:#x} is still asleep after wake_up", allocation=segment.index
                )
            if int(data.handle[1]) != segment.size_bytes:
                raise WakeError(
                    f"weights segment at {segment.address:#x} is {int(data.handle[1])} bytes, it was {segment.size_bytes} at the sleep",
                    allocation=segment.index,
                )
        return live_allocations(capture.segments)


_registration_lock = threading.Lock()


def register_sleep_backend() -> bool:
    """Register ``coldsnap`` with vLLM's ``SleepModeBackendFactory`` (idempotent, no CUDA init); ``False``: not pluggable here."""
    try:
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    except ImportError:
        logger.debug("coldsnap: this vLLM has no SleepModeBackendFactory; the coldsnap sleep backend is not registered")
        return False
    with _registration_lock:
        registry = getattr(SleepModeBackendFactory, "_registry", None)
        if isinstance(registry, dict) and BACKEND_NAME in registry:
            return True
        with contextlib.suppress(ValueError):  # "already registered": another path got there first
            SleepModeBackendFactory.register_backend(BACKEND_NAME, __name__, ColdsnapSleepBackend.__name__)
    return True
