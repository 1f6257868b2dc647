"""SGLang's view of the coldsnap settings: :mod:`coldsnap_core.settings` with materialization ``off``, the only
accepted value (SGLang's loader never materializes a missing pack, ``docs/format.md`` §13)."""

from __future__ import annotations

from collections.abc import Mapping

from coldsnap_core.errors import ConfigurationError
from coldsnap_core.settings import ColdsnapSettings

SGLANG_INNER_LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "pt", "npcache", "fastsafetensors", "instanttensor")
"""Load formats SGLang serves with ``DefaultModelLoader`` (``sglang/srt/configs/load_config.py``)."""


def resolve_sglang_settings(
    environ: Mapping[str, str], extra_config: Mapping[str, object] | str | None
) -> tuple[ColdsnapSettings, dict[str, object]]:
    """Resolve the settings for SGLang; return them and the extra config without coldsnap's keys. Raises
    ``ConfigurationError`` as :meth:`ColdsnapSettings.resolve`, and for ``materialize`` other than ``off``."""
    if isinstance(extra_config, str):  # SGLang parses the JSON in LoadConfig.__post_init__, but be lenient
        import json

        extra_config = json.loads(extra_config or "{}")
    settings, rest = ColdsnapSettings.resolve(
        environ, extra_config, materialize_default="off", inner_load_formats=SGLANG_INNER_LOAD_FORMATS
    )
    if settings.materialize != "off":
        raise ConfigurationError(
            f"COLDSNAP_MATERIALIZE={settings.materialize} is not supported with SGLang: its loader does not"
            " materialize a missing pack from the loaded weights; use COLDSNAP_MATERIALIZE=off (the SGLang default)"
            " and capture with COLDSNAP_EXPORT_MODEL_PAYLOAD=1"
        )
    return settings, rest
