"""Every coldsnap setting, in one table (:data:`SETTINGS`): each ``COLDSNAP_*`` variable, its extra-config key and
its parser; its default is the field's it sets, and README's settings table is made from it.

Three layers, the first given wins: a ``coldsnap`` option, an extra-config key, the variable; a blank value is as
unset; anything malformed is a ConfigurationError naming where and the value. The keys are removed from the extra
config before the engine's default loader sees it (vLLM ``DefaultModelLoader.__init__`` raises on unexpected keys).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from typing import Literal, get_args

from coldsnap_core.errors import ConfigurationError, redact_store_spec

DEFAULT_STATE_ROOT = Path("~/.cache/coldsnap")
PAYLOAD_DIR_ENV = "COLDSNAP_PAYLOAD_DIR"
PAYLOAD_REPO_ENV = "COLDSNAP_PAYLOAD_REPO"
PAYLOAD_REPO_TYPE_ENV = "COLDSNAP_PAYLOAD_REPO_TYPE"
LOCK_TIMEOUT_ENV = "COLDSNAP_LOCK_TIMEOUT"
OUTCOME_LOG_ENV = "COLDSNAP_OUTCOME_LOG"
STORE_CONNECT_TIMEOUT_ENV = "COLDSNAP_STORE_CONNECT_TIMEOUT"
STORE_READ_TIMEOUT_ENV = "COLDSNAP_STORE_READ_TIMEOUT"
STORE_RETRIES_ENV = "COLDSNAP_STORE_RETRIES"
STORE_MIN_RATE_ENV = "COLDSNAP_STORE_MIN_RATE"
STORE_RANGE_DEADLINE_ENV = "COLDSNAP_STORE_RANGE_DEADLINE"
OCI_MOUNT_FROM_ENV = "COLDSNAP_OCI_MOUNT_FROM"
STORE_TIMEOUT_MIN_S = 0.1
"""The shortest store timeout or deadline accepted (a shorter one fails every request: refused, not floored)."""
STORE_TIMEOUT_MAX_S = 86400.0
"""The longest store timeout accepted (1 day; a longer one overflows the clients' clocks)."""
STORE_RETRIES_MAX = 20
"""The most retries ``COLDSNAP_STORE_RETRIES`` accepts."""
LOCK_TIMEOUT_SECONDS = 600.0
"""Default wait for a digest's lock (``COLDSNAP_LOCK_TIMEOUT``), seconds."""

MaterializeMode = Literal["async", "required", "off"]
MATERIALIZE_MODES: tuple[str, ...] = get_args(MaterializeMode)
RestoreMode = Literal["auto", "native"]
OverlayMode = Literal["auto", "capture", "off"]
DerivedCacheMode = Literal["auto", "off"]
ConvertedCopies = Literal["residual", "model"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_SECONDS = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", re.ASCII)
"""A number of seconds as text: ASCII decimals (``float()`` also takes ``1_000``, any Unicode digit, ``1e3``, ``inf``)."""
_WHOLE = re.compile(r"[0-9]+", re.ASCII)


def expand_path(value: str | os.PathLike[str], where: str) -> Path:
    """``value`` as an absolute path with ``~`` and ``~user`` expanded; a ConfigurationError naming ``where`` when
    the home folder cannot be expanded or the path holds a NUL character."""
    if "\0" in os.fspath(value):
        raise ConfigurationError(f"{where}={os.fspath(value)!r} holds a NUL character, which no path can")
    try:
        return Path(value).expanduser().absolute()
    except RuntimeError as exc:
        raise ConfigurationError(f"{where}={str(value)!r}: cannot expand the home folder ({exc})") from None


def _string(where: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigurationError(f"{where} must be a string, got {value!r}")
    return value


def _flag(where: str, value: object) -> bool:
    """A boolean: ``1``/``0``, ``true``/``false``, ``yes``/``no``, ``on``/``off`` (case-insensitive), or a JSON one."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):  # JSON extra config: {"export_model_payload": 1}
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigurationError(f"{where}={value!r} is not a boolean; use 1 or 0")


def _path(where: str, value: object) -> Path:
    """A path: trimmed, ``~`` expanded, made absolute."""
    return expand_path(_string(where, value).strip(), where)


HF_REF_SCHEME = "hf://"
"""A Hugging Face repository in a REF: ``hf://org/name[@revision]/NAME``."""
ARTIFACT_REF_SCHEMES = ("oci://", "s3://", "gs://", "az://", HF_REF_SCHEME)
"""How a REF of a published artifact starts (``docs/format.md`` §12.9)."""


def _artifact_location(where: str, value: object) -> Path | str:
    """An artifact folder (:func:`_path`), or a REF (trimmed); a REF scheme misspelled is refused."""
    text = _string(where, value).strip()
    if text.startswith(ARTIFACT_REF_SCHEMES):
        return text
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):", text)
    if scheme is not None and f"{scheme.group(1).lower()}://" in ARTIFACT_REF_SCHEMES:
        raise ConfigurationError(
            f"{where}={redact_store_spec(text)!r} starts with the scheme {scheme.group(1)!r} misspelled (a REF starts"
            " oci://, s3://, gs://, az:// or hf://, in lower case), so it would be read as a folder",
            remedy="spell the REF's scheme as publish-native printed it, or give the artifact folder's path",
        )
    return expand_path(text, where)


def _choice(*allowed: str) -> Callable[[str, object], str]:
    """A choice: case-insensitive and trimmed."""

    def parse(where: str, value: object) -> str:
        text = _string(where, value).strip().lower()
        if text not in allowed:
            raise ConfigurationError(f"{where}={value!r} is not one of {', '.join(allowed)}")
        return text

    return parse


def _word(where: str, value: object) -> str:
    """A trimmed, lower-cased word (the inner load format, checked by :meth:`ColdsnapSettings.resolve`)."""
    return _string(where, value).strip().lower()


def _repositories(where: str, value: object) -> tuple[str, ...]:
    """A comma-separated list, each entry trimmed, empty entries dropped (checked by the store that uses it)."""
    return tuple(entry.strip() for entry in _string(where, value).split(",") if entry.strip())


def _seconds(value: object) -> float:
    """``value`` as seconds: ASCII decimal text (trimmed) or a JSON number; ``nan`` for anything else."""
    if isinstance(value, str):
        return float(value.strip()) if _SECONDS.fullmatch(value.strip()) else math.nan
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # a JSON integer beyond a float (10**400)
            return math.inf
    return math.nan


def _lock_seconds(where: str, value: object) -> float:
    """The lock timeout: a finite number of seconds >= 0 (not ``-0.0``, which compares equal to 0)."""
    seconds = _seconds(value)
    if not 0 <= seconds < math.inf or math.copysign(1.0, seconds) < 0:
        raise ConfigurationError(f"{where}={value!r} is not a number of seconds >= 0")
    return seconds


def _store_seconds(where: str, value: object) -> float:
    """A store timeout: a number of seconds from :data:`STORE_TIMEOUT_MIN_S` to :data:`STORE_TIMEOUT_MAX_S`."""
    seconds = _seconds(value)
    if not 0 < seconds <= STORE_TIMEOUT_MAX_S:
        raise ConfigurationError(f"{where}={value!r} is not a number of seconds > 0 and at most {STORE_TIMEOUT_MAX_S:g} (1 day)")
    if seconds < STORE_TIMEOUT_MIN_S:
        raise ConfigurationError(
            f"{where}={value!r} is under the minimum of {STORE_TIMEOUT_MIN_S:g} s: refused, not floored (a timeout that"
            " short fails every request)"
        )
    return seconds


def _byte_rate(where: str, value: object) -> float:
    """A rate: a finite number of bytes per second >= 0 (``0`` turns the rule off)."""
    rate = _seconds(value)  # the same spelling as seconds: ASCII decimals or a JSON number
    if not 0 <= rate < math.inf:
        raise ConfigurationError(f"{where}={value!r} is not a number of bytes per second >= 0")
    return rate


def _retry_count(where: str, value: object) -> int:
    """A store retry count: a whole number 0-:data:`STORE_RETRIES_MAX` (ASCII digits, or a JSON integer)."""
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
    """How a remote payload store's client talks to its server (``docs/format.md`` §12); each field: a :data:`SETTINGS` row."""

    connect_timeout_s: float = 10.0
    read_timeout_s: float = 20.0
    retries: int = 2
    min_rate_bytes_per_s: float = 65536.0
    range_deadline_s: float = 600.0
    oci_plain_http: bool = False
    oci_mount_from: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """Where packs come from when the node-local cache lacks them (:mod:`coldsnap_core.stores`); the fields are rows
    of :data:`SETTINGS` (trimmed; ``None`` when unset), but ``repo_where``: where ``payload_repo`` came from."""

    payload_dir: str | None = None
    payload_repo: str | None = None
    repo_type: str = "model"
    repo_where: str = field(default=PAYLOAD_REPO_ENV, compare=False)
    client: StoreClientSettings = StoreClientSettings()

    @property
    def configured(self) -> bool:
        """Whether a store is configured at all."""
        return self.payload_dir is not None or self.payload_repo is not None


@dataclass(frozen=True, slots=True)
class Setting:
    """One coldsnap setting (a row of :data:`SETTINGS`): ``key``: the extra-config key (and the ``coldsnap`` option
    ``--<key with dashes>``, where a command has one); ``variable``: the environment variable (``None``: key only);
    ``parse(where, value)``: the value of a non-blank input, or a ConfigurationError naming ``where``; ``meaning``: one
    line, as README's table shows it (Markdown); ``shown_default``: README's default cell where the default value
    cannot say it (``None``: the value); ``field``: the dotted :class:`ColdsnapSettings` attribute it sets (default
    ``key``), whose default is the setting's."""

    key: str
    variable: str | None
    parse: Callable[[str, object], object]
    meaning: str
    shown_default: str | None = None
    field: str = ""

    def __post_init__(self) -> None:
        if not self.field:
            object.__setattr__(self, "field", self.key)


ENGINE_DEFAULT = "the engine's"
"""README's default cell of a setting whose default each engine's adapter passes in."""

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "export_model_payload",
        "COLDSNAP_EXPORT_MODEL_PAYLOAD",
        _flag,
        "`1`: load from the checkpoint and capture this worker at the end of `load_weights`",
    ),
    Setting(
        "artifact_dir",
        "COLDSNAP_ARTIFACT_DIR",
        _artifact_location,
        "the artifact folder (`artifact.json`, one capsule per worker), or the REF of a published one (`oci://`,"
        " `s3://`, `gs://`, `az://`, `hf://`: pulled into `<state-root>/artifacts/sha256/<digest>/` before the restore);"
        " without it nothing is captured or restored",
    ),
    Setting(
        "state_root",
        "COLDSNAP_STATE_ROOT",
        _path,
        "node-local cache; packs at `model-payloads/sha256/<digest>.pack`",
    ),
    Setting(
        "restore",
        "COLDSNAP_RESTORE",
        _choice(*get_args(RestoreMode)),
        "`auto`: restore when the payload stages and verifies, else load the checkpoint with one WARNING; `native`: fail closed",
    ),
    Setting(
        "materialize",
        "COLDSNAP_MATERIALIZE",
        _choice(*MATERIALIZE_MODES),
        "after a fallback caused by a missing pack: rebuild it from the loaded bytes in the background (`async`),"
        " before the load reports success (`required`), or not (`off`); an engine refuses a mode it cannot run",
        ENGINE_DEFAULT,
    ),
    Setting(
        "verify_extents",
        "COLDSNAP_VERIFY_EXTENTS",
        _flag,
        "`1`: also hash every model extent while hydrating (restore and the level-1 wake)",
    ),
    Setting(
        "verify_checkpoint",
        "COLDSNAP_VERIFY_CHECKPOINT",
        _flag,
        "`1`: at restore, hash each local checkpoint file this node has no checkpoint record of in full (else its"
        " content fingerprint, a few MiB sampled, is compared; `docs/format.md` §10.1-§10.2)",
    ),
    Setting(
        "lock_timeout",
        LOCK_TIMEOUT_ENV,
        _lock_seconds,
        "seconds to wait for a pack's lock held by another process (a wait over 5 s is logged at INFO with the"
        " lock and its holder's pid); restore then fails with rule `lock-timeout` and `auto` falls back",
        field="lock_timeout_s",
    ),
    Setting(
        "outcome_log",
        OUTCOME_LOG_ENV,
        _path,
        "where every worker load appends one JSON line: restored / captured / fell-back / refused / checkpoint,"
        " with the rule and file (`docs/format.md` §10.3); `coldsnap status` summarizes it",
        "`<state-root>/load-outcomes.jsonl`",
    ),
    Setting(
        "termination_log",
        "COLDSNAP_TERMINATION_LOG",
        _path,
        "where a refused start (`COLDSNAP_RESTORE=native`) also writes its one `coldsnap:` line, when that file exists"
        " (Kubernetes' `terminationMessagePath`, shown by `kubectl describe pod`)",
    ),
    Setting(
        "inner_load_format",
        "COLDSNAP_INNER_LOAD_FORMAT",
        _word,
        "the engine's load format whose I/O the loader keeps",
        ENGINE_DEFAULT,
    ),
    Setting(
        "overlay",
        "COLDSNAP_OVERLAY",
        _choice(*get_args(OverlayMode)),
        "target-local overlays: `auto` selects this node's overlay for its target and captures one after a"
        " fallback caused by the target; `capture` loads the checkpoint and captures one now; `off` neither",
    ),
    Setting(
        "derived_cache",
        "COLDSNAP_DERIVED_CACHE",
        _choice(*get_args(DerivedCacheMode)),
        "derived-cache seeds (an engine's compile cache; `docs/format.md` §17): `auto` captures one into the capsule"
        " after an export's start compiled and places a qualified one before a restore's start compiles; `off` neither",
    ),
    Setting(
        "converted_copies",
        None,
        _choice(*get_args(ConvertedCopies)),
        "dtype-converting checkpoint copies (an fp32 checkpoint served as bf16) are model extents"
        " (`dtype_converted: true`, shared in the pack); `residual`: keep them in each worker's own residual blob",
    ),
    Setting(
        "payload_dir",
        PAYLOAD_DIR_ENV,
        _string,
        "a local or shared folder payload store (staging falls back to it when the cache misses); not with `payload_repo`",
        field="store.payload_dir",
    ),
    Setting(
        "payload_repo",
        PAYLOAD_REPO_ENV,
        _string,
        "a payload store: `s3://bucket[/prefix]` (AWS variables), `oci://HOST/NAMESPACE/NAME[:TAG]` (Docker config),"
        " `gs://bucket[/prefix]` (Google credentials), `az://account/container[/prefix]` or an Azure connection"
        ' string, a Hugging Face repository `org/name[@revision]` (`HF_*` variables) or a folder path; see "Payload'
        ' stores"',
        field="store.payload_repo",
    ),
    Setting(
        "payload_repo_type",
        PAYLOAD_REPO_TYPE_ENV,
        _string,
        "the Hugging Face repository type of `payload_repo`: `model` or `dataset`",
        field="store.repo_type",
    ),
    Setting(
        "store_connect_timeout",
        STORE_CONNECT_TIMEOUT_ENV,
        _store_seconds,
        "seconds a remote payload store's client (S3, OCI, GCS, Azure) waits for a connection (at least 0.1, at most 86400)",
        field="store.client.connect_timeout_s",
    ),
    Setting(
        "store_read_timeout",
        STORE_READ_TIMEOUT_ENV,
        _store_seconds,
        "seconds a remote payload store request may go without receiving a byte before it fails (at least 0.1, at most 86400); a stalled"
        " store fails as `payload-store` naming the store and this timeout",
        field="store.client.read_timeout_s",
    ),
    Setting(
        "store_retries",
        STORE_RETRIES_ENV,
        _retry_count,
        "retries of a failed remote payload store request (0-20), with back-off capped at a few seconds; S3 takes"
        " `AWS_MAX_ATTEMPTS` instead when it is set",
        field="store.client.retries",
    ),
    Setting(
        "store_min_rate",
        STORE_MIN_RATE_ENV,
        _byte_rate,
        "bytes per second a ranged read of a remote payload store must make over every read-timeout window (`0`: no"
        " floor); a slower (dripping) store fails as `payload-store` naming the store, the range and the rate",
        field="store.client.min_rate_bytes_per_s",
    ),
    Setting(
        "store_range_deadline",
        STORE_RANGE_DEADLINE_ENV,
        _store_seconds,
        "seconds one ranged read (64 MiB) of a remote payload store may take in all (at least 0.1, at most 86400); a"
        " range past it fails as `payload-store` naming the store, the range and the rate",
        field="store.client.range_deadline_s",
    ),
    Setting(
        "oci_plain_http",
        "COLDSNAP_OCI_PLAIN_HTTP",
        _flag,
        "`1`: speak plain HTTP to an OCI registry that is not on loopback (loopback always uses HTTP)",
        field="store.client.oci_plain_http",
    ),
    Setting(
        "oci_mount_from",
        OCI_MOUNT_FROM_ENV,
        _repositories,
        "repositories of the same OCI registry, comma-separated, to mount a blob from before uploading it",
        field="store.client.oci_mount_from",
    ),
)
"""Every coldsnap setting, in README's order."""

KEYS: dict[str, str | None] = {s.key: s.variable for s in SETTINGS}
"""Extra-config key -> environment variable (``None``: key only)."""

COMMAND_SETTINGS: tuple[Setting, ...] = tuple(
    s for s in SETTINGS if s.field.split(".")[0] in ("state_root", "lock_timeout_s", "outcome_log", "store")
)
"""The rows the ``coldsnap`` command reads; a value only a plugin reads never stops a command."""


def settings_table_markdown() -> list[str]:
    """README's settings table rows (``| variable | extra-config key | default | meaning |``), from :data:`SETTINGS`."""
    defaults, rows = ColdsnapSettings(), []
    for s in SETTINGS:
        value = reduce(getattr, s.field.split("."), defaults)
        if isinstance(value, bool | float):
            value = f"{value:g}"  # False -> 0, 600.0 -> 600
        shown = s.shown_default or ("none" if value in (None, ()) else f"`{value}`")
        rows.append(f"| {'—' if s.variable is None else f'`{s.variable}`'} | `{s.key}` | {shown} | {s.meaning} |")
    return rows


def _blank(value: object) -> bool:
    return isinstance(value, str) and not value.strip()


def _given(
    setting: Setting, environ: Mapping[str, str], extra: Mapping[str, object], flags: Mapping[str, object]
) -> tuple[str, object] | None:
    """Where ``setting`` is given and its value: its option, else its key, else its variable (``None``: not given)."""
    for where, layer in ((f"--{setting.key.replace('_', '-')}", flags), (f"extra-config key {setting.key!r}", extra)):
        if setting.key in layer and not _blank(layer[setting.key]):
            return where, layer[setting.key]
    if setting.variable is not None and not _blank(environ.get(setting.variable, "")):
        return setting.variable, environ[setting.variable]
    return None


@dataclass(frozen=True, slots=True)
class ColdsnapSettings:
    """The resolved settings of one coldsnap loader or command; each field is a :data:`SETTINGS` row, but
    ``artifact_ref``: ``COLDSNAP_ARTIFACT_DIR`` given as a REF, which the load pulls (``artifact_dir``: ``None`` until then)."""

    export_model_payload: bool = False
    artifact_dir: Path | None = None
    artifact_ref: str | None = None
    state_root: Path = DEFAULT_STATE_ROOT
    restore: RestoreMode = "auto"
    materialize: MaterializeMode = "off"
    verify_extents: bool = False
    verify_checkpoint: bool = False
    inner_load_format: str | None = None
    converted_copies: ConvertedCopies = "model"
    overlay: OverlayMode = "auto"
    derived_cache: DerivedCacheMode = "auto"
    lock_timeout_s: float = LOCK_TIMEOUT_SECONDS
    outcome_log: Path | None = None
    termination_log: Path = Path("/dev/termination-log")
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
        flags: Mapping[str, object] | None = None,
        rows: tuple[Setting, ...] = SETTINGS,
        materialize_default: MaterializeMode = "off",
        inner_load_formats: tuple[str, ...] = (),
    ) -> tuple[ColdsnapSettings, dict[str, object]]:
        """Resolve ``rows`` from a command's options (``flags``, by key), the loader's extra config and the environment
        (default ``os.environ``); return ``(settings, the extra config without coldsnap's keys)``.

        Raises:
            ConfigurationError: a value is malformed, settings do not combine (:func:`_check_combination`), or
                ``inner_load_format`` is not one of ``inner_load_formats`` (the engine's default loader serves).
        """
        environ = os.environ if environ is None else environ
        extra = dict(extra_config or {})
        flags = {k: v for k, v in (flags or {}).items() if v is not None}
        values: dict[str, object] = {}
        found: dict[str, tuple[str, object]] = {}  # field -> (where it was set, the value as given)
        for setting in rows:
            given = _given(setting, environ, extra, flags)
            if given is not None:
                found[setting.field], values[setting.field] = given, setting.parse(*given)
        inner_format = values.get("inner_load_format")
        if inner_format is not None and inner_format not in inner_load_formats:
            where, value = found["inner_load_format"]
            raise ConfigurationError(
                f"{where}={value!r} is not a load format served by the engine's default loader"
                f" ({', '.join(inner_load_formats) or 'none'})"
            )
        client = {k.removeprefix("store.client."): values.pop(k) for k in list(values) if k.startswith("store.client.")}
        directory = str(values.pop("store.payload_dir", "")).strip()
        repo = str(values.pop("store.payload_repo", "")).strip()
        repo_where = found.get("store.payload_repo", (PAYLOAD_REPO_ENV,))[0]
        if directory and repo:
            # the repository may be a connection string or URL with a secret: quoted redacted, as every store message
            dir_where = found["store.payload_dir"][0]
            raise ConfigurationError(
                f"set only one of {dir_where} ({directory!r}) and {repo_where} ({redact_store_spec(repr(repo))})"
            )
        repo_type = str(values.pop("store.repo_type", "")).strip() or "model"
        client_settings = StoreClientSettings(**client)  # type: ignore[arg-type]
        store = StoreSettings(directory or None, repo or None, repo_type, repo_where, client_settings)
        if isinstance(values.get("artifact_dir"), str):  # a REF: pulled by the load, never read as a folder
            values["artifact_ref"] = values.pop("artifact_dir")
        if "state_root" not in values:  # expanded only when used: a missing HOME does not matter when it is set
            values["state_root"] = expand_path(DEFAULT_STATE_ROOT, "the state root (COLDSNAP_STATE_ROOT unset)")
        settings = cls(**{"materialize": materialize_default, **values, "store": store})  # type: ignore[arg-type]
        _check_combination(settings)
        return settings, {k: v for k, v in extra.items() if k not in KEYS}


def _check_combination(settings: ColdsnapSettings) -> None:
    """ConfigurationError unless export, ``restore=native`` and ``overlay=capture`` have an artifact, the last no export."""
    no_artifact = settings.artifact_dir is None and settings.artifact_ref is None
    if settings.artifact_ref is not None and settings.export_model_payload:
        raise ConfigurationError(
            f"COLDSNAP_EXPORT_MODEL_PAYLOAD=1 writes an artifact folder; COLDSNAP_ARTIFACT_DIR={settings.artifact_ref!r}"
            " is the REF of a published one: export into a folder, then publish it (coldsnap publish-native)"
        )
    if no_artifact and settings.export_model_payload:
        raise ConfigurationError(
            "COLDSNAP_EXPORT_MODEL_PAYLOAD=1 needs an artifact folder: set COLDSNAP_ARTIFACT_DIR"
            " (or the extra-config key 'artifact_dir')"
        )
    if settings.overlay == "capture" and (no_artifact or settings.export_model_payload):
        raise ConfigurationError(
            "COLDSNAP_OVERLAY=capture captures a target-local overlay of an existing artifact: it needs"
            " COLDSNAP_ARTIFACT_DIR and excludes COLDSNAP_EXPORT_MODEL_PAYLOAD=1 (which captures the portable artifact)"
        )
    if no_artifact and settings.restore == "native":
        raise ConfigurationError(
            "COLDSNAP_RESTORE=native needs an artifact folder to restore from, and COLDSNAP_ARTIFACT_DIR is not set",
            remedy="set COLDSNAP_ARTIFACT_DIR (or the extra-config key 'artifact_dir') to the artifact folder or its REF",
        )
