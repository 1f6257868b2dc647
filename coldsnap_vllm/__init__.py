"""coldsnap_vllm: the vLLM plugin. ``register()`` is the ``vllm.general_plugins`` entry point, which vLLM calls once
per process (API server, engine core, every worker; vLLM ``plugins/__init__.py``): idempotent, cheap, no CUDA init."""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register the load format and the sleep backend ``coldsnap``, make the first process repeat a worker's refusal
    line at its exit, and place the seed's model-class inspection cache before vLLM builds its configuration."""
    from coldsnap_core.operator_log import install_last_words
    from coldsnap_vllm.early_seed import place_early
    from coldsnap_vllm.loader import register_loader
    from coldsnap_vllm.sleep import register_sleep_backend

    register_loader()
    register_sleep_backend()
    install_last_words()
    place_early()
