"""The engine plugins' settings: environment variables, overridable by ``--model-loader-extra-config`` keys.

Shared by the vLLM loader (``coldsnap_vllm``) and the SGLang loader (``coldsnap_sglang``); each engine
passes its own default for ``materialize`` (vLLM ``async``, SGLang ``off``) and the inner load formats
its default loader serves.

=============================  ==========================  ==================================================
environment variable           extra-config key            meaning (default)
=============================  ==========================  ==================================================
COLDSNAP_EXPORT_MODEL_PAYLOAD  ``export_model_payload``    ``1``: load from the checkpoint and capture this
                                                           worker's pack, residual and manifests (``0``)
COLDSNAP_ARTIFACT_DIR          ``artifact_dir``            the artifact folder (``artifact.json`` and the
                                                           unit capsules); no default: without it the loader
                                                           loads from the checkpoint and neither captures nor
                                                           restores
COLDSNAP_STATE_ROOT            ``state_root``              the node-local cache root (``~/.cache/coldsnap``);
                                                           packs live at
                                                           ``model-payloads/sha256/<digest>.pack`` under it
COLDSNAP_RESTORE               ``restore``                 ``auto``: restore from the payload when it can be
                                                           staged and verified, else load from the checkpoint
                                                           with one WARNING; ``native``: fail closed (``auto``)
COLDSNAP_MATERIALIZE           ``materialize``             after a recovery load, write the missing pack:
                                                           ``async`` / ``required`` / ``off`` (``async``)
COLDSNAP_VERIFY_EXTENTS        ``verify_extents``          ``1``: hash every model extent while hydrating (``0``)
COLDSNAP_VERIFY_CHECKPOINT     ``verify_checkpoint``       ``1``: at restore, hash every local checkpoint file
                                                           this node has no checkpoint record of (``0``:
                                                           compare its content fingerprint instead)
COLDSNAP_OVERLAY               ``overlay``                 target-local overlays (``docs/format.md`` §15):
                                                           ``auto``: select this node's overlay for this
                                                           target, and capture one after a fallback caused
                                                           by target qualification; ``capture``: load the
                                                           checkpoint and capture one now (an operator's
                                                           explicit command); ``off``: neither (``auto``)
COLDSNAP_LOCK_TIMEOUT          ``lock_timeout``            seconds to wait for a pack's lock held by another
                                                           process (``600``); restore then fails with
                                                           ``LockTimeoutError`` (``auto`` falls back), a
                                                           writer proceeds without the lock
COLDSNAP_OUTCOME_LOG           ``outcome_log``             the load outcome log each worker load appends one
                                                           JSON line to (``<state-root>/load-outcomes.jsonl``;
                                                           ``docs/format.md`` §10.3)
COLDSNAP_INNER_LOAD_FORMAT     ``inner_load_format``       the vLLM load format whose I/O the loader keeps
                                                           (``instanttensor`` on CUDA, ``safetensors``
                                                           elsewhere)
COLDSNAP_PAYLOAD_DIR           ``payload_dir``             a folder payload store packs are fetched from when
                                                           the node-local cache lacks them (none)
COLDSNAP_PAYLOAD_REPO          ``payload_repo``            a Hugging Face payload store ``org/name[@revision]``
                                                           (or a path: a folder store); not with
                                                           ``payload_dir`` (none)
COLDSNAP_PAYLOAD_REPO_TYPE     ``payload_repo_type``       ``model`` or ``dataset`` (``model``)
(none)                         ``converted_copies``        ``model`` (default) or ``residual``: whether a
                                                           dtype-converting checkpoint copy is a model extent
                                                           (with ``dtype_converted: true``) or residual
=============================  ==========================  ==================================================

An extra-config key wins over its environment variable. Values are read leniently in form only: choices
are case-insensitive and trimmed, an empty value means the default, booleans are ``1``/``0``,
``true``/``false``, ``yes``/``no``, ``on``/``off`` (or JSON ``true``/``false``/``1``/``0`` in the extra
config), paths are trimmed, ``~``-expanded and made absolute. Anything else is a
:class:`~coldsnap_core.errors.ConfigurationError` naming the variable or key and the value.

These keys are removed from the extra config before the engine's default loader sees it (it rejects keys
it does not know: vLLM ``DefaultModelLoader.__init__`` raises on unexpected extra-config keys). Nothing here
names a pack: a pack's path is always derived from its SHA-256.

The environment is read only where a plugin or the CLI starts: an engine plugin calls
:meth:`ColdsnapSettings.resolve` when its loader is built and hands the resolved settings down (the cache,
the payload store, the restore, the sleep backend's extent verification through the published load state);
the ``coldsnap`` command resolves ``--state-root`` / ``COLDSNAP_STATE_ROOT``, ``COLDSNAP_LOCK_TIMEOUT``,
``COLDSNAP_OUTCOME_LOG`` and the payload store variables when it starts. This module imports no
implementation module, so every layer can use it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from coldsnap_core.errors import ConfigurationError

STATE_ROOT_ENV = "COLDSNAP_STATE_ROOT"
DEFAULT_STATE_ROOT = Path("~/.cache/coldsnap")
PAYLOAD_DIR_ENV = "COLDSNAP_PAYLOAD_DIR"
PAYLOAD_REPO_ENV = "COLDSNAP_PAYLOAD_REPO"
PAYLOAD_REPO_TYPE_ENV = "COLDSNAP_PAYLOAD_REPO_TYPE"
MATERIALIZE_ENV = "COLDSNAP_MATERIALIZE"
LOCK_TIMEOUT_ENV = "COLDSNAP_LOCK_TIMEOUT"
OUTCOME_LOG_ENV = "COLDSNAP_OUTCOME_LOG"
LOCK_TIMEOUT_SECONDS = 600.0
"""Default wait for a digest's lock (``COLDSNAP_LOCK_TIMEOUT`` overrides it): a writer then proceeds
without the lock, a reader (admission, staging, ``cache verify``) fails with
:class:`~coldsnap_core.errors.LockTimeoutError`."""

MaterializeMode = Literal["async", "required", "off"]
MATERIALIZE_MODES: tuple[str, ...] = get_args(MaterializeMode)
RestoreMode = Literal["auto", "native"]
OverlayMode = Literal["auto", "capture", "off"]
ConvertedCopies = Literal["residual", "model"]

RESTORE_MODES: tuple[str, ...] = ("auto", "native")
OVERLAY_MODES: tuple[str, ...] = ("auto", "capture", "off")
CONVERTED_COPIES: tuple[str, ...] = ("residual", "model")
VLLM_INNER_LOAD_FORMATS: tuple[str, ...] = (
    "auto",
    "hf",
    "safetensors",
    "fastsafetensors",
    "instanttensor",
    "mistral",
    "pt",
    "npcache",
)
"""The load formats vLLM serves with ``DefaultModelLoader`` (``model_loader/__init__.py``), whose I/O
the coldsnap loader can keep."""
INNER_LOAD_FORMATS = VLLM_INNER_LOAD_FORMATS

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")

#: extra-config key -> environment variable (``None``: key only).
KEYS: dict[str, str | None] = {
    "export_model_payload": "COLDSNAP_EXPORT_MODEL_PAYLOAD",
    "artifact_dir": "COLDSNAP_ARTIFACT_DIR",
    "state_root": "COLDSNAP_STATE_ROOT",
    "restore": "COLDSNAP_RESTORE",
    "materialize": "COLDSNAP_MATERIALIZE",
    "verify_extents": "COLDSNAP_VERIFY_EXTENTS",
    "verify_checkpoint": "COLDSNAP_VERIFY_CHECKPOINT",
    "inner_load_format": "COLDSNAP_INNER_LOAD_FORMAT",
    "overlay": "COLDSNAP_OVERLAY",
    "payload_dir": PAYLOAD_DIR_ENV,
    "payload_repo": PAYLOAD_REPO_ENV,
    "payload_repo_type": PAYLOAD_REPO_TYPE_ENV,
    "lock_timeout": "COLDSNAP_LOCK_TIMEOUT",
    "outcome_log": OUTCOME_LOG_ENV,
    "converted_copies": None,
}


def parse_flag(where: str, value: object) -> bool:
    """A boolean setting, spelled as every coldsnap boolean is: ``1``/``0``, ``true``/``false``,
    ``yes``/``no``, ``on``/``off`` (case-insensitive, trimmed; empty is ``False``), or a JSON
    ``true``/``false``/``1``/``0`` from an extra config.

    Raises:
        ConfigurationError: anything else, naming ``where`` and the value.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):  # JSON extra config: {"export_model_payload": 1}
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigurationError(f"{where}={value!r} is not a boolean; use 1 or 0")


_SECONDS = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", re.ASCII)
"""A number of seconds as ``COLDSNAP_LOCK_TIMEOUT`` takes it: ASCII decimal digits, an optional fraction."""


def lock_timeout_from_env(
    environ: Mapping[str, str] | None = None, *, value: object = None, where: str = LOCK_TIMEOUT_ENV
) -> float:
    """The lock timeout in seconds: ``value`` if given, else ``$COLDSNAP_LOCK_TIMEOUT``, else
    :data:`LOCK_TIMEOUT_SECONDS` (an empty value means the default).

    Raises:
        ConfigurationError: the value is not a finite number of seconds >= 0 (names ``where``).
    """
    if value is None:
        value = (os.environ if environ is None else environ).get(LOCK_TIMEOUT_ENV, "")
    if isinstance(value, str) and not value.strip():
        return LOCK_TIMEOUT_SECONDS
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str) and not _SECONDS.fullmatch(text):
        # float() also takes "1_000", "١٠" (any Unicode digit), "inf" and "nan": only plain ASCII decimals are seconds
        seconds = float("nan")
    else:
        try:
            seconds = float(text)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            seconds = float("nan")
    if isinstance(value, bool) or not (0 <= seconds < float("inf")):
        raise ConfigurationError(f"{where}={value!r} is not a number of seconds >= 0")
    return seconds


def expand_path(value: str | os.PathLike[str], where: str) -> Path:
    """``value`` as an absolute path with ``~`` and ``~user`` expanded.

    Raises:
        ConfigurationError: ``~user`` names no user here (pathlib's ``RuntimeError``), naming ``where``
            (the variable, extra-config key or option the path came from) and the value.
    """
    try:
        return Path(value).expanduser().absolute()
    except RuntimeError as exc:
        raise ConfigurationError(f"{where}={str(value)!r}: cannot expand the home folder ({exc})") from None


def outcome_log_from_env(environ: Mapping[str, str] | None = None) -> Path | None:
    """``$COLDSNAP_OUTCOME_LOG`` as an absolute path (``~`` expanded), ``None`` when unset or blank: the
    rule :meth:`ColdsnapSettings.resolve` applies to the ``outcome_log`` key."""
    value = (os.environ if environ is None else environ).get(OUTCOME_LOG_ENV, "").strip()
    return expand_path(value, OUTCOME_LOG_ENV) if value else None


def resolve_state_root(explicit: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """The state root: ``explicit``, else ``$COLDSNAP_STATE_ROOT``, else ``~/.cache/coldsnap``.

    An empty (or all-blank) value counts as not given, for the argument and the variable alike, so
    ``--state-root ""`` and ``COLDSNAP_STATE_ROOT=`` both mean the default, never the current folder
    (as :meth:`ColdsnapSettings.resolve` reads ``COLDSNAP_STATE_ROOT``).
    """
    environ = os.environ if environ is None else environ
    chosen: str | os.PathLike[str] | None = explicit
    where = "--state-root"
    if chosen is None or not str(chosen).strip():
        chosen, where = environ.get(STATE_ROOT_ENV, ""), STATE_ROOT_ENV
    if not str(chosen).strip():
        chosen = DEFAULT_STATE_ROOT
    return expand_path(chosen, where)


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """Where packs come from when the node-local cache lacks them (see :mod:`coldsnap_core.stores`).

    Attributes:
        payload_dir: a folder store (``COLDSNAP_PAYLOAD_DIR``), as given but trimmed, or ``None``.
        payload_repo: a Hugging Face repository ``org/name[@revision]``, or a path (a folder store)
            (``COLDSNAP_PAYLOAD_REPO``), trimmed, or ``None``.
        repo_type: ``COLDSNAP_PAYLOAD_REPO_TYPE`` (``model`` when unset or empty), trimmed.
        repo_where: where ``payload_repo`` came from (the variable or the extra-config key), for messages.
    """

    payload_dir: str | None = None
    payload_repo: str | None = None
    repo_type: str = "model"
    repo_where: str = field(default=PAYLOAD_REPO_ENV, compare=False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> StoreSettings:
        """The store settings of the environment alone (the CLI, and callers without an engine).

        Raises:
            ConfigurationError: both a folder and a repository are set (names both variables).
        """
        env = os.environ if environ is None else environ
        return cls._checked(
            env.get(PAYLOAD_DIR_ENV, ""), env.get(PAYLOAD_REPO_ENV, ""), env.get(PAYLOAD_REPO_TYPE_ENV, ""), PAYLOAD_DIR_ENV
        )

    @classmethod
    def _checked(
        cls, directory: str, repo: str, repo_type: str, dir_where: str, repo_where: str = PAYLOAD_REPO_ENV
    ) -> StoreSettings:
        directory, repo = directory.strip(), repo.strip()
        if directory and repo:
            raise ConfigurationError(f"set only one of {dir_where} ({directory!r}) and {repo_where} ({repo!r})")
        return cls(directory or None, repo or None, repo_type.strip() or "model", repo_where)

    @property
    def configured(self) -> bool:
        """Whether a store is configured at all."""
        return self.payload_dir is not None or self.payload_repo is not None


@dataclass(frozen=True, slots=True)
class ColdsnapSettings:
    """The resolved settings of one coldsnap loader (see the module docstring for each field's source).

    Attributes:
        export_model_payload: capture this worker after loading from the checkpoint.
        artifact_dir: the artifact folder (absolute), or ``None``.
        state_root: the node-local cache root (absolute after :meth:`resolve`).
        restore: ``auto`` or ``native``.
        materialize: ``async``, ``required`` or ``off``.
        verify_extents: hash every model extent while hydrating.
        verify_checkpoint: at restore, hash local checkpoint files without a checkpoint record.
        inner_load_format: the vLLM load format to keep, or ``None`` for the platform default.
        converted_copies: ``model`` (converted copies are model extents, the default) or ``residual``.
        overlay: ``auto``, ``capture`` or ``off`` (target-local overlays).
        lock_timeout_s: seconds to wait for a pack's lock (:meth:`coldsnap_core.cache.PayloadCache.lock`).
        outcome_log: the load outcome log (absolute), or ``None`` for
            ``<state_root>/load-outcomes.jsonl`` (:attr:`outcome_log_path`).
        store: the payload store settings (``COLDSNAP_PAYLOAD_DIR`` / ``COLDSNAP_PAYLOAD_REPO``).
    """

    export_model_payload: bool = False
    artifact_dir: Path | None = None
    state_root: Path = DEFAULT_STATE_ROOT
    restore: RestoreMode = "auto"
    materialize: MaterializeMode = "async"
    verify_extents: bool = False
    verify_checkpoint: bool = False
    inner_load_format: str | None = None
    converted_copies: ConvertedCopies = "model"
    overlay: OverlayMode = "auto"
    lock_timeout_s: float = LOCK_TIMEOUT_SECONDS
    outcome_log: Path | None = None
    store: StoreSettings = StoreSettings()

    @property
    def outcome_log_path(self) -> Path:
        """Where this loader appends its load outcome lines (``docs/format.md`` §10.3)."""
        return self.outcome_log if self.outcome_log is not None else self.state_root / "load-outcomes.jsonl"

    @classmethod
    def resolve(
        cls,
        environ: Mapping[str, str] | None = None,
        extra_config: Mapping[str, object] | None = None,
        *,
        materialize_default: MaterializeMode = "async",
        inner_load_formats: tuple[str, ...] = VLLM_INNER_LOAD_FORMATS,
    ) -> tuple[ColdsnapSettings, dict[str, object]]:
        """Resolve the settings from the environment and the loader's extra config.

        Args:
            environ: the environment (default ``os.environ``).
            extra_config: ``LoadConfig.model_loader_extra_config``.
            materialize_default: the engine's default materialization mode (vLLM ``async``).
            inner_load_formats: the load formats the engine's default loader serves.

        Returns:
            ``(settings, rest)``: the settings, and the extra config without coldsnap's keys (for
            vLLM's ``DefaultModelLoader``).

        Raises:
            ConfigurationError: a value is not one of the allowed ones (the message names the
                variable or key, the value and what is allowed), ``export_model_payload`` or
                ``restore=native`` is set without an artifact folder, or ``inner_load_format`` names
                a format whose loader is not vLLM's ``DefaultModelLoader`` (``coldsnap`` included).
        """
        environ = os.environ if environ is None else environ
        extra = dict(extra_config or {})
        rest = {k: v for k, v in extra.items() if k not in KEYS}
        raw: dict[str, tuple[str, object]] = {}
        for key, variable in KEYS.items():
            if key in extra:
                raw[key] = (f"extra-config key {key!r}", extra[key])
            elif variable is not None and variable in environ:
                raw[key] = (variable, environ[variable])

        def text(key: str) -> tuple[str, str] | None:
            if key not in raw:
                return None
            where, value = raw[key]
            if not isinstance(value, str):
                raise ConfigurationError(f"{where} must be a string, got {value!r}")
            return where, value

        def flag(key: str) -> bool:
            if key not in raw:
                return False
            return parse_flag(*raw[key])

        def store() -> StoreSettings:
            found = {key: text(key) for key in ("payload_dir", "payload_repo", "payload_repo_type")}
            directory, repo, repo_type = (("", "") if f is None else f for f in found.values())
            return StoreSettings._checked(
                directory[1], repo[1], repo_type[1], directory[0] or PAYLOAD_DIR_ENV, repo[0] or PAYLOAD_REPO_ENV
            )

        def choice(key: str, allowed: tuple[str, ...], default: str) -> str:
            found = text(key)
            if found is None:
                return default
            where, value = found
            value = value.strip().lower() or default
            if value not in allowed:
                raise ConfigurationError(f"{where}={found[1]!r} is not one of {', '.join(allowed)}")
            return value

        def path(key: str) -> Path | None:
            found = text(key)
            if found is None or not found[1].strip():
                return None
            return expand_path(found[1].strip(), found[0])

        inner = text("inner_load_format")
        inner_format = inner[1].strip().lower() or None if inner else None
        if inner is not None and inner_format is not None and inner_format not in inner_load_formats:
            raise ConfigurationError(
                f"{inner[0]}={inner[1]!r} is not a load format served by the engine's default loader"
                f" ({', '.join(inner_load_formats)})"
            )
        settings = cls(
            export_model_payload=flag("export_model_payload"),
            artifact_dir=path("artifact_dir"),
            state_root=path("state_root") or DEFAULT_STATE_ROOT.expanduser().absolute(),
            restore=choice("restore", RESTORE_MODES, "auto"),  # type: ignore[arg-type]
            materialize=choice("materialize", MATERIALIZE_MODES, materialize_default),  # type: ignore[arg-type]
            verify_extents=flag("verify_extents"),
            verify_checkpoint=flag("verify_checkpoint"),
            inner_load_format=inner_format,
            converted_copies=choice("converted_copies", CONVERTED_COPIES, "model"),  # type: ignore[arg-type]
            overlay=choice("overlay", OVERLAY_MODES, "auto"),  # type: ignore[arg-type]
            lock_timeout_s=lock_timeout_from_env(value=raw["lock_timeout"][1], where=raw["lock_timeout"][0])
            if "lock_timeout" in raw
            else LOCK_TIMEOUT_SECONDS,
            outcome_log=path("outcome_log"),
            store=store(),
        )
        if settings.artifact_dir is None and settings.export_model_payload:
            raise ConfigurationError(
                "COLDSNAP_EXPORT_MODEL_PAYLOAD=1 needs an artifact folder: set COLDSNAP_ARTIFACT_DIR"
                " (or the extra-config key 'artifact_dir')"
            )
        if settings.overlay == "capture" and (settings.artifact_dir is None or settings.export_model_payload):
            raise ConfigurationError(
                "COLDSNAP_OVERLAY=capture captures a target-local overlay of an existing artifact: it needs"
                " COLDSNAP_ARTIFACT_DIR and excludes COLDSNAP_EXPORT_MODEL_PAYLOAD=1 (which captures the portable artifact)"
            )
        if settings.artifact_dir is None and settings.restore == "native":
            raise ConfigurationError(
                "COLDSNAP_RESTORE=native needs an artifact folder to restore from: set COLDSNAP_ARTIFACT_DIR"
                " (or the extra-config key 'artifact_dir')"
            )
        return settings, rest
