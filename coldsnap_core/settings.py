"""The engine plugins' settings: environment variables, overridable by ``--model-loader-extra-config`` keys.

Shared by the vLLM loader (``coldsnap_vllm``) and the SGLang loader (``coldsnap_sglang``); each engine
passes its own default for ``materialize`` (vLLM ``async``, SGLang ``off``) and the inner load formats
its default loader serves.

Each setting is declared once, in :data:`SETTINGS` (extra-config key, variable, parser, default and a
one-line meaning): :meth:`ColdsnapSettings.resolve` follows it, the list at the end of this docstring is
made from it, and README's settings table is compared with it row by row
(``tests/core/test_settings.py``).

An extra-config key wins over its environment variable. Values are read leniently in form only: choices
are case-insensitive and trimmed, an empty or blank (whitespace-only) value means the default for every setting
(as if it were unset: a blank extra-config key lets its variable apply; ``VAR=`` is how a shell unsets a
variable for one command; the ``coldsnap`` command's
readers follow the same rule), booleans are ``1``/``0``,
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

The settings (:data:`SETTINGS`; ``—``: none):

"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from coldsnap_core.errors import ConfigurationError, redact_store_spec

STATE_ROOT_ENV = "COLDSNAP_STATE_ROOT"
DEFAULT_STATE_ROOT = Path("~/.cache/coldsnap")
PAYLOAD_DIR_ENV = "COLDSNAP_PAYLOAD_DIR"
PAYLOAD_REPO_ENV = "COLDSNAP_PAYLOAD_REPO"
PAYLOAD_REPO_TYPE_ENV = "COLDSNAP_PAYLOAD_REPO_TYPE"
MATERIALIZE_ENV = "COLDSNAP_MATERIALIZE"
LOCK_TIMEOUT_ENV = "COLDSNAP_LOCK_TIMEOUT"
OUTCOME_LOG_ENV = "COLDSNAP_OUTCOME_LOG"
STORE_CONNECT_TIMEOUT_ENV = "COLDSNAP_STORE_CONNECT_TIMEOUT"
STORE_READ_TIMEOUT_ENV = "COLDSNAP_STORE_READ_TIMEOUT"
STORE_RETRIES_ENV = "COLDSNAP_STORE_RETRIES"
STORE_CONNECT_TIMEOUT_S = 10.0
"""Default seconds a payload store client waits for a TCP connection (``COLDSNAP_STORE_CONNECT_TIMEOUT``)."""
STORE_READ_TIMEOUT_S = 20.0
"""Default seconds a payload store request may go without receiving a byte (``COLDSNAP_STORE_READ_TIMEOUT``)."""
STORE_RETRIES = 2
"""Default retries of a failed payload store request (``COLDSNAP_STORE_RETRIES``): 3 attempts in all."""
STORE_TIMEOUT_MAX_S = 86400.0
"""The longest store timeout ``COLDSNAP_STORE_CONNECT_TIMEOUT`` / ``COLDSNAP_STORE_READ_TIMEOUT`` accept (1 day): a
longer one overflows the clients' clocks (``OverflowError: timestamp out of range``) and only hides a dead store."""
STORE_RETRIES_MAX = 20
"""The most retries ``COLDSNAP_STORE_RETRIES`` accepts (more only multiplies how long a dead store holds a lock)."""
LOCK_TIMEOUT_SECONDS = 600.0
"""Default wait for a digest's lock (``COLDSNAP_LOCK_TIMEOUT`` overrides it): a writer then proceeds
without the lock, a reader (admission, staging, ``cache verify``) fails with
:class:`~coldsnap_core.errors.LockTimeoutError`."""

MaterializeMode = Literal["async", "required", "off"]
MATERIALIZE_MODES: tuple[str, ...] = get_args(MaterializeMode)
RestoreMode = Literal["auto", "native"]
OverlayMode = Literal["auto", "capture", "off"]
DerivedCacheMode = Literal["auto", "off"]
DERIVED_CACHE_MODES: tuple[str, ...] = get_args(DerivedCacheMode)
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
        except (TypeError, ValueError, OverflowError):  # OverflowError: a JSON integer beyond a float (10**400)
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


_WHOLE = re.compile(r"[0-9]+", re.ASCII)


def positive_seconds(where: str, value: object) -> float | None:
    """A store timeout: a number of seconds > 0 and at most :data:`STORE_TIMEOUT_MAX_S` in ASCII decimals (``2``, ``0.5``; trimmed), or a JSON
    number from an extra config; blank means the default (``None``).

    Raises:
        ConfigurationError: anything else (``0``, ``-1``, ``inf``, ``nan``, ``1_000``, non-ASCII digits, more than
            :data:`STORE_TIMEOUT_MAX_S`), naming ``where`` and the value.
    """
    if isinstance(value, str) and not value.strip():
        return None
    text = value.strip() if isinstance(value, str) else value
    number = isinstance(text, int | float) and not isinstance(text, bool)  # a JSON number from an extra config
    try:
        seconds = float(text) if number or (isinstance(text, str) and _SECONDS.fullmatch(text)) else float("nan")  # type: ignore[arg-type]
    except OverflowError:  # a JSON integer beyond a float (10**400)
        seconds = float("inf")
    if not (0 < seconds <= STORE_TIMEOUT_MAX_S):
        raise ConfigurationError(f"{where}={value!r} is not a number of seconds > 0 and at most {STORE_TIMEOUT_MAX_S:g} (1 day)")
    return seconds


def retry_count(where: str, value: object) -> int | None:
    """A store retry count: a whole number 0-:data:`STORE_RETRIES_MAX` in ASCII digits (trimmed), or a JSON
    integer from an extra config; blank means the default (``None``).

    Raises:
        ConfigurationError: anything else, naming ``where`` and the value.
    """
    if isinstance(value, str) and not value.strip():
        return None
    count = -1
    if isinstance(value, str) and _WHOLE.fullmatch(value.strip()):
        count = int(value.strip())
    elif isinstance(value, int) and not isinstance(value, bool):
        count = value
    if not 0 <= count <= STORE_RETRIES_MAX:
        raise ConfigurationError(f"{where}={value!r} is not a whole number of retries from 0 to {STORE_RETRIES_MAX}")
    return count


@dataclass(frozen=True, slots=True)
class StoreClientSettings:
    """How a payload store's client talks to its server (``docs/format.md`` §12: every remote store).

    Attributes:
        connect_timeout_s: seconds to wait for a TCP connection (``COLDSNAP_STORE_CONNECT_TIMEOUT``).
        read_timeout_s: seconds a request may go without receiving a byte (``COLDSNAP_STORE_READ_TIMEOUT``).
        retries: retries of a failed request, so ``retries + 1`` attempts at most (``COLDSNAP_STORE_RETRIES``).
    """

    connect_timeout_s: float = STORE_CONNECT_TIMEOUT_S
    read_timeout_s: float = STORE_READ_TIMEOUT_S
    retries: int = STORE_RETRIES

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> StoreClientSettings:
        """The client settings of the environment alone (the CLI's ``--repo``).

        Raises:
            ConfigurationError: a value is invalid (names the variable and the value).
        """
        env = os.environ if environ is None else environ
        values = {
            name: parsed
            for name, variable, parse in (
                ("connect_timeout_s", STORE_CONNECT_TIMEOUT_ENV, positive_seconds),
                ("read_timeout_s", STORE_READ_TIMEOUT_ENV, positive_seconds),
                ("retries", STORE_RETRIES_ENV, retry_count),
            )
            if (parsed := parse(variable, env.get(variable, ""))) is not None
        }
        return cls(**values)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """Where packs come from when the node-local cache lacks them (see :mod:`coldsnap_core.stores`).

    Attributes:
        payload_dir: a folder store (``COLDSNAP_PAYLOAD_DIR``), as given but trimmed, or ``None``.
        payload_repo: a Hugging Face repository ``org/name[@revision]``, or a path (a folder store)
            (``COLDSNAP_PAYLOAD_REPO``), trimmed, or ``None``.
        repo_type: ``COLDSNAP_PAYLOAD_REPO_TYPE`` (``model`` when unset or empty), trimmed.
        repo_where: where ``payload_repo`` came from (the variable or the extra-config key), for messages.
        client: timeouts and retries of a remote store's client.
    """

    payload_dir: str | None = None
    payload_repo: str | None = None
    repo_type: str = "model"
    repo_where: str = field(default=PAYLOAD_REPO_ENV, compare=False)
    client: StoreClientSettings = StoreClientSettings()

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> StoreSettings:
        """The store settings of the environment alone (the CLI, and callers without an engine).

        Raises:
            ConfigurationError: both a folder and a repository are set (names both variables), or a store
                client setting is invalid (names the variable and the value).
        """
        env = os.environ if environ is None else environ
        return cls._checked(
            env.get(PAYLOAD_DIR_ENV, ""),
            env.get(PAYLOAD_REPO_ENV, ""),
            env.get(PAYLOAD_REPO_TYPE_ENV, ""),
            PAYLOAD_DIR_ENV,
            client=StoreClientSettings.from_environ(env),
        )

    @classmethod
    def _checked(
        cls,
        directory: str,
        repo: str,
        repo_type: str,
        dir_where: str,
        repo_where: str = PAYLOAD_REPO_ENV,
        client: StoreClientSettings = StoreClientSettings(),
    ) -> StoreSettings:
        directory, repo = directory.strip(), repo.strip()
        if directory and repo:
            # the repository may be a connection string or URL with a secret: quoted redacted, as every store message
            raise ConfigurationError(
                f"set only one of {dir_where} ({directory!r}) and {repo_where} ({redact_store_spec(repr(repo))})"
            )
        return cls(directory or None, repo or None, repo_type.strip() or "model", repo_where, client)

    @property
    def configured(self) -> bool:
        """Whether a store is configured at all."""
        return self.payload_dir is not None or self.payload_repo is not None


def _string(where: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigurationError(f"{where} must be a string, got {value!r}")
    return value


def _path(where: str, value: object) -> Path | None:
    """A path setting: trimmed, ``~`` expanded, made absolute; blank means the default (``None``)."""
    text = _string(where, value).strip()
    return expand_path(text, where) if text else None


def _choice(*allowed: str) -> Callable[[str, object], str | None]:
    """A choice setting: case-insensitive and trimmed; blank means the default (``None``)."""

    def parse(where: str, value: object) -> str | None:
        text = _string(where, value).strip().lower()
        if text and text not in allowed:
            raise ConfigurationError(f"{where}={value!r} is not one of {', '.join(allowed)}")
        return text or None

    return parse


def _word(where: str, value: object) -> str | None:
    """A trimmed, lower-cased word (the inner load format, checked against the engine's list by
    :meth:`ColdsnapSettings.resolve`); blank means the default (``None``)."""
    return _string(where, value).strip().lower() or None


def _seconds(where: str, value: object) -> float:
    return lock_timeout_from_env(value=value, where=where)


def _text(where: str, value: object) -> str:
    """Text kept as given (a payload store; trimmed by :class:`StoreSettings`)."""
    return _string(where, value)


@dataclass(frozen=True, slots=True)
class Setting:
    """One coldsnap setting, declared once (a row of :data:`SETTINGS`).

    Attributes:
        key: the ``--model-loader-extra-config`` key.
        variable: the environment variable, or ``None`` (extra-config key only).
        field: the :class:`ColdsnapSettings` attribute it sets (``store.<name>``: a
            :class:`StoreSettings` or :class:`StoreClientSettings` attribute).
        parse: ``parse(where, value)``: the value, or ``None`` for the default (a blank value);
            raises :class:`~coldsnap_core.errors.ConfigurationError` naming ``where`` and the value.
        default: the default, as README's table shows it (Markdown).
        meaning: one line, as README's table shows it (Markdown).
    """

    key: str
    variable: str | None
    field: str
    parse: Callable[[str, object], object]
    default: str
    meaning: str


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "export_model_payload",
        "COLDSNAP_EXPORT_MODEL_PAYLOAD",
        "export_model_payload",
        parse_flag,
        "`0`",
        "`1`: load from the checkpoint and capture this worker at the end of `load_weights`",
    ),
    Setting(
        "artifact_dir",
        "COLDSNAP_ARTIFACT_DIR",
        "artifact_dir",
        _path,
        "none",
        "the artifact folder (`artifact.json`, one capsule per worker); without it nothing is captured or restored",
    ),
    Setting(
        "state_root",
        STATE_ROOT_ENV,
        "state_root",
        _path,
        "`~/.cache/coldsnap`",
        "node-local cache; packs at `model-payloads/sha256/<digest>.pack`",
    ),
    Setting(
        "restore",
        "COLDSNAP_RESTORE",
        "restore",
        _choice(*RESTORE_MODES),
        "`auto`",
        "`auto`: restore when the payload stages and verifies, else load the checkpoint with one WARNING; `native`: fail closed",
    ),
    Setting(
        "materialize",
        MATERIALIZE_ENV,
        "materialize",
        _choice(*MATERIALIZE_MODES),
        "`async` (vLLM), `off` (SGLang)",
        "after a fallback caused by a missing pack: rebuild it from the loaded bytes in the background (`async`),"
        " before the load reports success (`required`), or not (`off`, the only value SGLang accepts)",
    ),
    Setting(
        "verify_extents",
        "COLDSNAP_VERIFY_EXTENTS",
        "verify_extents",
        parse_flag,
        "`0`",
        "`1`: also hash every model extent while hydrating (restore and the level-1 wake)",
    ),
    Setting(
        "verify_checkpoint",
        "COLDSNAP_VERIFY_CHECKPOINT",
        "verify_checkpoint",
        parse_flag,
        "`0`",
        "`1`: at restore, hash each local checkpoint file this node has no checkpoint record of in full (else its"
        " content fingerprint, a few MiB sampled, is compared; `docs/format.md` §10.1-§10.2)",
    ),
    Setting(
        "lock_timeout",
        LOCK_TIMEOUT_ENV,
        "lock_timeout_s",
        _seconds,
        "`600`",
        "seconds to wait for a pack's lock held by another process (a wait over 5 s is logged at INFO with the"
        " lock and its holder's pid); restore then fails with rule `lock-timeout` and `auto` falls back; also read"
        " by the `coldsnap` command",
    ),
    Setting(
        "outcome_log",
        OUTCOME_LOG_ENV,
        "outcome_log",
        _path,
        "`<state-root>/load-outcomes.jsonl`",
        "where every worker load appends one JSON line: restored / captured / fell-back / refused / checkpoint,"
        " with the rule and file (`docs/format.md` §10.3); `coldsnap status` summarizes it",
    ),
    Setting(
        "inner_load_format",
        "COLDSNAP_INNER_LOAD_FORMAT",
        "inner_load_format",
        _word,
        "`instanttensor` on CUDA, `safetensors` elsewhere",
        "the engine's load format whose I/O the loader keeps",
    ),
    Setting(
        "overlay",
        "COLDSNAP_OVERLAY",
        "overlay",
        _choice(*OVERLAY_MODES),
        "`auto`",
        "target-local overlays: `auto` selects this node's overlay for its target and captures one after a"
        " fallback caused by the target; `capture` loads the checkpoint and captures one now; `off` neither",
    ),
    Setting(
        "derived_cache",
        "COLDSNAP_DERIVED_CACHE",
        "derived_cache",
        _choice(*DERIVED_CACHE_MODES),
        "`auto`",
        "derived-cache seeds (vLLM's compile cache; `docs/format.md` §17): `auto` captures one into the capsule"
        " after an export's start compiled and places a qualified one before a restore's start compiles; `off` neither",
    ),
    Setting(
        "converted_copies",
        None,
        "converted_copies",
        _choice(*CONVERTED_COPIES),
        "`model`",
        "dtype-converting checkpoint copies (an fp32 checkpoint served as bf16) are model extents"
        " (`dtype_converted: true`, shared in the pack); `residual`: keep them in each worker's own residual blob",
    ),
    Setting(
        "payload_dir",
        PAYLOAD_DIR_ENV,
        "store.payload_dir",
        _text,
        "none",
        "a local or shared folder payload store (staging falls back to it when the cache misses); not with `payload_repo`",
    ),
    Setting(
        "payload_repo",
        PAYLOAD_REPO_ENV,
        "store.payload_repo",
        _text,
        "none",
        "a payload store: `s3://bucket[/prefix]` (AWS variables), `oci://HOST/NAMESPACE/NAME[:TAG]` (Docker config),"
        " `gs://bucket[/prefix]` (Google credentials), `az://account/container[/prefix]` or an Azure connection"
        ' string, a Hugging Face repository `org/name[@revision]` (`HF_*` variables) or a folder path; see "Payload'
        ' stores"',
    ),
    Setting(
        "payload_repo_type",
        PAYLOAD_REPO_TYPE_ENV,
        "store.repo_type",
        _text,
        "`model`",
        "the Hugging Face repository type of `payload_repo`: `model` or `dataset`",
    ),
    Setting(
        "store_connect_timeout",
        STORE_CONNECT_TIMEOUT_ENV,
        "store.connect_timeout_s",
        positive_seconds,
        "`10`",
        "seconds a remote payload store's client (S3, OCI, GCS, Azure) waits for a connection (> 0, at most 86400)",
    ),
    Setting(
        "store_read_timeout",
        STORE_READ_TIMEOUT_ENV,
        "store.read_timeout_s",
        positive_seconds,
        "`20`",
        "seconds a remote payload store request may go without receiving a byte before it fails (> 0, at most 86400); a stalled"
        " store fails as `payload-store` naming the store and this timeout",
    ),
    Setting(
        "store_retries",
        STORE_RETRIES_ENV,
        "store.retries",
        retry_count,
        "`2`",
        "retries of a failed remote payload store request (0-20), with back-off capped at a few seconds; S3 takes"
        " `AWS_MAX_ATTEMPTS` instead when it is set",
    ),
)
"""Every coldsnap setting, in README's order."""

KEYS: dict[str, str | None] = {s.key: s.variable for s in SETTINGS}
"""Extra-config key -> environment variable (``None``: key only)."""


def settings_table_markdown() -> list[str]:
    """README's settings table rows (``| variable | extra-config key | default | meaning |``), from :data:`SETTINGS`."""
    return [f"| {'—' if s.variable is None else f'`{s.variable}`'} | `{s.key}` | {s.default} | {s.meaning} |" for s in SETTINGS]


def _settings_rst() -> str:
    rows = []
    for s in SETTINGS:
        variable = "—" if s.variable is None else f"``{s.variable}``"
        meaning = s.meaning.replace("`", "``")
        rows.append(f"{variable} / ``{s.key}`` (default {s.default.replace('`', '``')})\n    {meaning}\n")
    return "\n".join(rows)


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
        derived_cache: ``auto`` or ``off`` (derived-cache seeds, ``docs/format.md`` §17).
        lock_timeout_s: seconds to wait for a pack's lock (:meth:`coldsnap_core.cache.payload_cache.PayloadCache.lock`).
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
    derived_cache: DerivedCacheMode = "auto"
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

        Each row of :data:`SETTINGS` is looked up once: its extra-config key, else its variable, parsed
        by its parser; a blank key is as if absent (its variable applies), a blank variable means the default.

        Returns:
            ``(settings, rest)``: the settings, and the extra config without coldsnap's keys (for
            the engine's ``DefaultModelLoader``).

        Raises:
            ConfigurationError: a value is not one of the allowed ones (the message names the
                variable or key, the value and what is allowed), ``export_model_payload`` or
                ``restore=native`` is set without an artifact folder, or ``inner_load_format`` names
                a format whose loader is not vLLM's ``DefaultModelLoader`` (``coldsnap`` included).
        """
        environ = os.environ if environ is None else environ
        extra = dict(extra_config or {})
        rest = {k: v for k, v in extra.items() if k not in KEYS}
        values: dict[str, object] = {}
        found: dict[str, tuple[str, object]] = {}  # field -> (where it was set, the value as given)
        for setting in SETTINGS:
            given = extra.get(setting.key)
            # a blank key is as if absent (the module docstring): its variable, if set, applies
            if setting.key in extra and not (isinstance(given, str) and not given.strip()):
                where, value = f"extra-config key {setting.key!r}", given
            elif setting.variable is not None and setting.variable in environ:
                where, value = setting.variable, environ[setting.variable]
            else:
                continue
            found[setting.field] = (where, value)
            parsed = setting.parse(where, value)
            if parsed is not None:
                values[setting.field] = parsed
        inner_format = values.get("inner_load_format")
        if inner_format is not None and inner_format not in inner_load_formats:
            where, given = found["inner_load_format"]
            raise ConfigurationError(
                f"{where}={given!r} is not a load format served by the engine's default loader ({', '.join(inner_load_formats)})"
            )
        store = StoreSettings._checked(
            str(values.pop("store.payload_dir", "")),
            str(values.pop("store.payload_repo", "")),
            str(values.pop("store.repo_type", "")),
            found.get("store.payload_dir", (PAYLOAD_DIR_ENV, None))[0],
            found.get("store.payload_repo", (PAYLOAD_REPO_ENV, None))[0],
            client=StoreClientSettings(
                **{name.removeprefix("store."): values.pop(name) for name in list(values) if name.startswith("store.")}  # type: ignore[arg-type]
            ),
        )
        settings = cls(
            **{
                "materialize": materialize_default,
                "state_root": DEFAULT_STATE_ROOT.expanduser().absolute(),
                **values,  # type: ignore[arg-type]
                "store": store,
            }
        )
        _check_combination(settings)
        return settings, rest


def _check_combination(settings: ColdsnapSettings) -> None:
    """The rules between settings: export and ``restore=native`` need an artifact folder;
    ``overlay=capture`` needs one and excludes export.

    Raises:
        ConfigurationError: a rule is broken (names the settings).
    """
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


__doc__ = (__doc__ or "") + _settings_rst()
