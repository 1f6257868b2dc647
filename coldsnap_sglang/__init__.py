"""coldsnap_sglang: the SGLang plugin (``--load-format coldsnap``: capture and restore of model payloads).
``register()`` is the ``sglang.srt.plugins`` entry point (``pyproject.toml``), called in the launcher and every
scheduler process before arguments are parsed. The Python API needs no plugin:
``sgl.Engine(model_path=..., load_format=ColdsnapModelLoader)``."""

from __future__ import annotations

import threading

__all__ = ["LOAD_FORMAT", "register"]

LOAD_FORMAT = "coldsnap"
_lock = threading.Lock()
_registered = False


def swap_load_format(load_config: object, *args: object, **kwargs: object) -> None:
    """BEFORE hook of ``LoadConfig._verify_load_format``: ``"coldsnap"`` becomes the loader class."""
    value = getattr(load_config, "load_format", None)
    if isinstance(value, str) and value.lower() == LOAD_FORMAT:
        from coldsnap_sglang.loader import ColdsnapModelLoader

        load_config.load_format = ColdsnapModelLoader  # type: ignore[attr-defined]


def register() -> None:
    """Register ``--load-format coldsnap`` with SGLang (idempotent; initialises no device): add it to the choices,
    swap it for the loader class in ``LoadConfig._verify_load_format`` (SGLang passes a class ``load_format`` straight
    to ``get_model_loader``), and make the launcher repeat a scheduler's refusal line at its exit.

    Raises:
        EngineVersionError: SGLang's plugin API (``add_load_format_choices``, ``HookRegistry``) is missing.
    """
    global _registered
    with _lock:
        if _registered:
            return
        from coldsnap_core.errors import EngineVersionError

        try:
            from sglang.srt.plugins.hook_registry import HookRegistry, HookType
            from sglang.srt.server_args import add_load_format_choices
        except ImportError as exc:
            raise EngineVersionError(
                f"coldsnap_sglang needs SGLang's plugin API (sglang >= 0.5.11): {exc}; on older SGLang pass "
                "load_format=coldsnap_sglang.loader.ColdsnapModelLoader to sgl.Engine"
            ) from exc
        from sglang.srt import server_args

        choices = getattr(server_args, "LOAD_FORMAT_CHOICES", None)
        if choices is None or LOAD_FORMAT not in choices:
            add_load_format_choices([LOAD_FORMAT])
        HookRegistry.register("sglang.srt.configs.load_config.LoadConfig._verify_load_format", swap_load_format, HookType.BEFORE)
        from coldsnap_core.operator_log import install_last_words

        install_last_words()
        _registered = True
