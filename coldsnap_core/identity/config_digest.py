"""The digest of the engine's effective model configuration, and the keys in which two differ (``docs/format.md`` §4.8)."""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Mapping

CONFIG_DIGEST_DOMAIN = b"coldsnap-model-config-v1\n"
VOLATILE_CONFIG_KEYS = frozenset({"transformers_version"})
"""Keys left out of the configuration digest besides every key that starts with ``_``."""


def _canonical(value: object) -> object:
    """``value`` as plain JSON data, deterministically (no addresses, sorted sets)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if isinstance(value, Mapping):
        return {
            str(k): _canonical(v)
            for k, v in value.items()
            if not (isinstance(k, str) and (k.startswith("_") or k in VOLATILE_CONFIG_KEYS))
        }
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((_canonical(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    if hasattr(value, "to_dict") and hasattr(value, "__dict__"):
        # A (nested) Hugging Face config: its public attributes as set (what model code reads), not
        # ``to_dict()``, whose output follows each transformers version's serialization rules.
        return _canonical(vars(value))
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else text


def canonical_model_config(hf_config: object, *, dtype: object, quantization: object = None) -> str:
    """The canonical JSON whose SHA-256 is :func:`model_config_sha256` (sorted keys, no spaces, ASCII)."""
    document = {"hf_config": _canonical(hf_config), "dtype": _canonical(dtype), "quantization": _canonical(quantization)}
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def config_json_sha256(config_json: str) -> str:
    """The configuration digest (``docs/format.md`` §4.8) of a canonical configuration JSON.

    Raises:
        UnicodeEncodeError: ``config_json`` is not ASCII (canonical JSON always is).
    """
    return hashlib.sha256(CONFIG_DIGEST_DOMAIN + config_json.encode("ascii")).hexdigest()


def model_config_sha256(hf_config: object, *, dtype: object, quantization: object = None) -> str:
    """:func:`config_json_sha256` of :func:`canonical_model_config`."""
    return config_json_sha256(canonical_model_config(hf_config, dtype=dtype, quantization=quantization))


def engine_model_config(model_config: object) -> str | None:
    """:func:`canonical_model_config` of a vLLM or SGLang ``ModelConfig``; ``None`` when it has no ``hf_config``."""
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is None:
        return None
    return canonical_model_config(
        hf_config, dtype=getattr(model_config, "dtype", None), quantization=getattr(model_config, "quantization", None)
    )


def config_differences(recorded_json: str, loaded_json: str, *, limit: int = 5) -> list[str]:
    """The dotted keys in which two canonical configurations differ (``docs/format.md`` §4.8), at most ``limit``."""

    def flat(value: object, path: str, into: dict[str, object]) -> dict[str, object]:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                flat(item, f"{path}.{key}" if path else str(key), into)
        else:
            into[path] = value
        return into

    recorded, loaded = flat(json.loads(recorded_json), "", {}), flat(json.loads(loaded_json), "", {})

    def shown(side: dict[str, object], key: str) -> str:
        return json.dumps(side[key], sort_keys=True) if key in side else "absent"

    differing = sorted(k for k in recorded.keys() | loaded.keys() if recorded.get(k, ...) != loaded.get(k, ...))
    lines = [f"{k}: {shown(loaded, k)} (engine) vs {shown(recorded, k)} (artifact)" for k in differing[:limit]]
    if len(differing) > limit:
        lines.append(f"... and {len(differing) - limit} more")
    return lines
