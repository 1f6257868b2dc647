"""coldsnap_vllm: the vLLM plugin.

``register()`` is the ``vllm.general_plugins`` entry point (``pyproject.toml``). vLLM calls it once per process
(API server, engine core, every worker; vLLM ``plugins/__init__.py``), so it is idempotent, cheap, and never
initialises CUDA.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register the load format ``coldsnap`` (:mod:`coldsnap_vllm.loader`) and the sleep backend ``coldsnap``
    (:mod:`coldsnap_vllm.sleep`), make the first process repeat a worker's refusal line at its exit
    (:func:`coldsnap_core.operator_log.install_last_words`), and place the seed's model-class inspection cache
    before vLLM builds its configuration (:func:`coldsnap_vllm.early_seed.place_early`; never raises)."""
    from coldsnap_core.operator_log import install_last_words
    from coldsnap_vllm.early_seed import place_early
    from coldsnap_vllm.loader import register_loader
    from coldsnap_vllm.sleep import register_sleep_backend

    register_loader()
    register_sleep_backend()
    install_last_words()
    place_early()
