"""SGLang's view of the coldsnap settings: :mod:`coldsnap_core.settings` with materialization ``off``.

SGLang's integration restores payloads that already exist; it does not implement the canonical
model-payload writer (``docs/format.md`` §13: SGLang defaults to ``off`` and rejects ``async`` and
``required``), so ``COLDSNAP_MATERIALIZE`` must be ``off`` (the default here) and
``COLDSNAP_EXPORT_MODEL_PAYLOAD`` must be unset.
"""

from __future__ import annotations

from collections.abc import Mapping

from coldsnap_core.errors import ConfigurationError
from coldsnap_core.settings import ColdsnapSettings

SGLANG_INNER_LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "pt", "npcache", "fastsafetensors", "instanttensor")
"""Load formats SGLang serves with ``DefaultModelLoader`` (``sglang/srt/configs/load_config.py``)."""


def resolve_sglang_settings(
    environ: Mapping[str, str], extra_config: Mapping[str, object] | str | None
) -> tuple[ColdsnapSettings, dict[str, object]]:
    """Resolve the settings for SGLang; return them and the extra config without coldsnap's keys.

    Raises:
        ConfigurationError: any :meth:`ColdsnapSettings.resolve` error; ``materialize`` other than
            ``off``; ``export_model_payload`` set (SGLang cannot capture).
    """
    if isinstance(extra_config, str):  # SGLang parses the JSON in LoadConfig.__post_init__, but be lenient
        import json

        extra_config = json.loads(extra_config or "{}")
    settings, rest = ColdsnapSettings.resolve(
        environ, extra_config, materialize_default="off", inner_load_formats=SGLANG_INNER_LOAD_FORMATS
    )
    if settings.materialize != "off":
        raise ConfigurationError(
            f"COLDSNAP_MATERIALIZE={settings.materialize} is not supported with SGLang: its integration does not "
            "implement the canonical model-payload writer; use off (the SGLang default) and build payloads with vLLM"
            " or `coldsnap` tooling"
        )
    if settings.export_model_payload:
        raise ConfigurationError(
            "COLDSNAP_EXPORT_MODEL_PAYLOAD=1 is not supported with SGLang: it restores already-built payloads only"
        )
    return settings, rest
