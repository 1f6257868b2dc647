"""Registration of the ``coldsnap`` sleep backend with vLLM's real ``SleepModeBackendFactory``."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.device_allocator.sleep_mode_backend")

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend, SleepModeBackendFactory

from coldsnap_vllm.sleep import BACKEND_NAME, ColdsnapSleepBackend, register_sleep_backend


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict:
    """A private copy of the factory's registry (the built-in ``cumem`` only), restored afterwards."""
    copy = {name: loader for name, loader in SleepModeBackendFactory._registry.items() if name != BACKEND_NAME}
    monkeypatch.setattr(SleepModeBackendFactory, "_registry", copy)
    return copy


def test_registers_coldsnap_lazily_and_resolves_the_backend(registry: dict) -> None:
    """After registration vLLM resolves ``--sleep-mode-backend coldsnap`` to ColdsnapSleepBackend, a
    real SleepModeBackend subclass. Fails if the name, module path or class name is wrong."""
    assert register_sleep_backend() is True
    assert set(registry) == {"cumem", BACKEND_NAME}
    cls = SleepModeBackendFactory.get_backend_class(BACKEND_NAME)
    assert cls is ColdsnapSleepBackend
    assert issubclass(cls, SleepModeBackend)
    assert cls.preserves_communicators() is True


def test_registration_is_idempotent(registry: dict) -> None:
    """vLLM loads general plugins once per process but in every process, and the factory raises on a
    second registration: calling twice keeps the first loader and raises nothing."""
    register_sleep_backend()
    loader = registry[BACKEND_NAME]
    assert register_sleep_backend() is True
    assert registry[BACKEND_NAME] is loader


def test_a_backend_registered_elsewhere_is_left_alone(registry: dict) -> None:
    """If the name is already taken (an earlier registration path), nothing is replaced or raised."""

    def other() -> type:
        return SleepModeBackend

    registry[BACKEND_NAME] = other
    assert register_sleep_backend() is True
    assert registry[BACKEND_NAME] is other


def test_missing_factory_is_feature_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM without pluggable sleep backends: registration reports False instead of failing the
    plugin (which vLLM would only log)."""
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.sleep_mode_backend", None)
    assert register_sleep_backend() is False


def test_vllm_refuses_the_backend_where_cumem_is_unavailable(registry: dict) -> None:
    """On this CPU build there is no CuMem allocator: vLLM's factory refuses to create the backend
    ("not supported on this platform") instead of constructing one that cannot sleep."""
    register_sleep_backend()
    if ColdsnapSleepBackend.is_supported():
        pytest.skip("CuMem is available here (GPU build)")
    with pytest.raises(ValueError, match="not supported on this platform"):
        SleepModeBackendFactory.create_backend(SimpleNamespace(sleep_mode_backend=BACKEND_NAME))


def test_registration_initialises_no_cuda_and_imports_no_copy_backend() -> None:
    """The plugin runs in the API server too, which may fork: registering must not import cupy, the
    CUDA copy backend or initialise torch.cuda (checked in a fresh interpreter)."""
    code = (
        "import sys, torch\n"
        "from coldsnap_vllm.sleep import register_sleep_backend\n"
        "assert register_sleep_backend()\n"
        "bad = [m for m in ('cupy', 'coldsnap_core.copy.cuda') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")
