"""coldsnap_vllm: the vLLM plugin.

``register()`` is the ``vllm.general_plugins`` entry point (``pyproject.toml``). vLLM calls it once per
process in the API server, the engine core and every worker (vLLM ``plugins/__init__.py``,
``load_general_plugins``), so it
is idempotent, cheap, and never initialises CUDA. It registers

* the load format ``coldsnap`` (:mod:`coldsnap_vllm.loader`), and
* the sleep-mode backend ``coldsnap`` (:mod:`coldsnap_vllm.sleep`), where vLLM has pluggable backends,

makes the first process of a start (vLLM's API server) repeat a worker's refusal line at its exit, after
vLLM's tracebacks (:func:`coldsnap_core.operator_log.install_last_words`),
and, once per process, places the derived-cache seed's copy of vLLM's model-class inspection cache
(:func:`coldsnap_vllm.early_seed.place_early`, ``docs/format.md`` §17.4): vLLM calls it before it builds
the model configuration, which reads that cache. That placement never raises.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register coldsnap's load format and sleep backend with vLLM (idempotent), then place the seed's
    model-class inspection cache (once per process; never raises)."""
    from coldsnap_core.operator_log import install_last_words
    from coldsnap_vllm.early_seed import place_early
    from coldsnap_vllm.loader import register_loader
    from coldsnap_vllm.sleep import register_sleep_backend

    register_loader()
    register_sleep_backend()
    install_last_words()
    place_early()
