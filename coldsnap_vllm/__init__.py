"""coldsnap_vllm: the vLLM plugin.

``register()`` is the ``vllm.general_plugins`` entry point (``pyproject.toml``). vLLM calls it once per
process in the API server, the engine core and every worker (vLLM ``plugins/__init__.py``,
``load_general_plugins``), so it
is idempotent, cheap, and never initialises CUDA. It registers

* the load format ``coldsnap`` (:mod:`coldsnap_vllm.loader`), and
* the sleep-mode backend ``coldsnap`` (:mod:`coldsnap_vllm.sleep`), where vLLM has pluggable backends.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register coldsnap's load format and sleep backend with vLLM (idempotent)."""
    from coldsnap_vllm.loader import register_loader
    from coldsnap_vllm.sleep import register_sleep_backend

    register_loader()
    register_sleep_backend()
