"""The one exception hierarchy of coldsnap: each class names the *rule* it enforces (``docs/format.md``) and the exit
code of a CLI command it stops (§8), and each error the context that failed, so a log line alone says what and why::

    coldsnap: rule extent-sha256 failed: model extent 17 does not match its SHA-256 (expected 3f2a..., got 9be1...)
        [file=/cache/model-payloads/sha256/ab..cd.pack, allocation=12, offset_bytes=4096]
"""

from __future__ import annotations

import re
from os import PathLike

EXIT_INTEGRITY = 1
EXIT_MANIFEST = 2
EXIT_MISSING = 3
EXIT_OTHER = 4
EXIT_TARGET = 5

_REPULL = "pull the artifact again (`coldsnap pull REF DIR`) or export it again; an artifact file was damaged or edited"
_SERVE_AS_CAPTURED = (
    "serve the model the artifact was captured from with the flags it was captured with (--model, --dtype,"
    " --tensor-parallel-size), or export an artifact for this one (`coldsnap export`)"
)


class ColdsnapError(Exception):
    """Base class of every error coldsnap raises: ``rule <rule> failed: <detail> [<context>]; remedy: <remedy>``.
    ``detail``: what was found, in words; ``file``, ``allocation``, ``offset_bytes``: where, if known (``offset_bytes``
    within the allocation, else within ``file``); ``remedy``: the one thing an operator should do, where the raise site
    knows better than the class's ``remedy``."""

    rule: str = "coldsnap"
    exit_code: int = EXIT_OTHER
    remedy: str | None = None

    def __init_subclass__(cls, rule: str | None = None, **kwargs: object) -> None:
        """``class X(Base, rule="...")`` sets ``X.rule``."""
        super().__init_subclass__(**kwargs)
        if rule is not None:
            cls.rule = rule

    def __init__(
        self,
        detail: str,
        *,
        file: str | PathLike[str] | None = None,
        allocation: int | None = None,
        offset_bytes: int | None = None,
        remedy: str | None = None,
    ) -> None:
        self.detail = detail
        self.file = None if file is None else str(file)
        self.allocation = allocation
        self.offset_bytes = offset_bytes
        if remedy is not None:
            self.remedy = remedy
        super().__init__(self._compose())

    def renaming_file(self, names: dict[str, str]) -> ColdsnapError:
        """Name ``names[old]`` wherever this error names ``old`` (its ``file`` and its detail); returns ``self``
        (an error raised on a ``/proc/self/fd/<n>`` name, :func:`coldsnap_core.format.verify.pinned_file`)."""
        for old, new in names.items():
            if self.file == old:
                self.file = new
            self.detail = self.detail.replace(old, new)
        self.args = (self._compose(),)
        return self

    def with_remedy(self, remedy: str) -> ColdsnapError:
        """Set this error's remedy to ``remedy``; returns ``self``."""
        self.remedy = remedy
        self.args = (self._compose(),)
        return self

    def _compose(self) -> str:
        where = {"file": self.file, "allocation": self.allocation, "offset_bytes": self.offset_bytes}
        context = ", ".join(f"{name}={value}" for name, value in where.items() if value is not None)
        suffix = f" [{context}]" if context else ""
        remedy = f"; remedy: {self.remedy}" if self.remedy else ""
        return f"rule {self.rule} failed: {self.detail}{suffix}{remedy}"


_SECRET_VALUE = re.compile(r"(?i)\b(AccountKey|SharedAccessSignature|sig|X-Amz-Signature|X-Goog-Signature)=([^;&\s'\"]*)")
_URL_USERINFO = re.compile(r"(://)[^/\s'\"]*@")
# a URL's query string or fragment (a SAS token, a presigned signature), up to a quote or a space
_URL_QUERY = re.compile(r"(://[^?#\s'\"]*)[?#][^\s'\"]*")


def redact_store_spec(text: str) -> str:
    """``text`` (a store setting, or a message quoting one) with its secrets (:data:`_SECRET_VALUE`, a URL's
    ``user:password@``, query string or fragment) replaced by ``***``."""
    text = _SECRET_VALUE.sub(r"\1=***", text)
    text = _URL_USERINFO.sub(r"\1***@", text)
    return _URL_QUERY.sub(r"\1?***", text)


class _RedactedMessage(ColdsnapError):
    """An error whose detail and file go through :func:`redact_store_spec` (they may quote a store)."""

    def __init__(self, detail: str, *, file: str | PathLike[str] | None = None, **kwargs: int | str | None) -> None:
        super().__init__(redact_store_spec(detail), file=None if file is None else redact_store_spec(str(file)), **kwargs)


class ManifestError(ColdsnapError, rule="manifest"):
    """A manifest, descriptor or record is malformed, unsupported or internally inconsistent."""

    exit_code = EXIT_MANIFEST
    remedy = _REPULL


class ManifestParseError(ManifestError, rule="manifest-json"):
    """The file is not valid UTF-8 JSON."""


class ManifestSchemaError(ManifestError, rule="manifest-schema"):
    """A field is missing, mistyped or unknown, or the document kind is wrong."""


class UnsupportedFormatVersionError(ManifestError, rule="format-version"):
    """The document declares a format version this release does not read (only 9 is read)."""


class ManifestValueError(ManifestError, ValueError, rule="manifest-value"):
    """A field's value is out of range or malformed, or a rule across fields fails; a ``ValueError`` so that msgspec
    names the JSON path when a format type's ``__post_init__`` raises it."""


class ExtentBoundsError(ManifestError, rule="extent-within-allocation"):
    """An extent lies (partly) outside its allocation, or names an allocation that does not exist."""


class ExtentOverlapError(ManifestError, rule="maps-disjoint"):
    """Two extents (model or residual, in any combination) cover the same allocation byte."""


class CoverageGapError(ManifestError, rule="maps-cover-allocation"):
    """Some byte of a preserved allocation is covered by neither the model nor the residual map."""


class PackLayoutError(ManifestError, rule="pack-canonical-layout"):
    """The model extent map does not describe a canonical pack (``docs/format.md`` §2)."""


class ResidualLayoutError(ManifestError, rule="residual-canonical-layout"):
    """The residual extent map does not describe the blob (back to back, in map order, from offset 0)."""


class ExtentOrderError(ManifestError, rule="extent-order"):
    """An extent map is not sorted by (allocation_index, offset_bytes)."""


class LayoutMismatchError(ManifestError, rule="layout-fingerprint"):
    """The live allocations do not have the layout fingerprint the manifest records (``docs/format.md`` §4.4)."""

    remedy = _SERVE_AS_CAPTURED


class AllocationSizeMismatchError(ManifestError, rule="allocation-size"):
    """A live allocation's size differs from the size recorded in the allocation map."""

    remedy = _SERVE_AS_CAPTURED


class IntegrityError(ColdsnapError, rule="integrity"):
    """Bytes on disk (or in memory) do not match what the manifest or the digest promises."""

    exit_code = EXIT_INTEGRITY


class PackSizeMismatchError(IntegrityError, rule="pack-size"):
    """The pack file's size differs from the manifest's ``size_bytes`` (a truncated or extended pack)."""


class PackDigestMismatchError(IntegrityError, rule="pack-sha256"):
    """The pack file's SHA-256 differs from the digest that names it."""


class PackPathMismatchError(IntegrityError, rule="pack-path"):
    """The pack's path is not ``model-payloads/sha256/<sha256>.pack`` for its recorded SHA-256."""


class NonZeroPaddingError(IntegrityError, rule="pack-padding-zero"):
    """A padding byte between (or after) pack extents is not zero."""


class ExtentDigestMismatchError(IntegrityError, rule="extent-sha256"):
    """A model extent's bytes do not match the extent's recorded SHA-256."""


class ResidualSizeMismatchError(IntegrityError, rule="residual-size"):
    """The residual blob's size differs from the manifest's (a truncated or extended blob)."""

    remedy = _REPULL


def size_mismatch(
    error: type[IntegrityError],
    what: str,
    actual_bytes: int,
    expected_bytes: int,
    *,
    file: str | PathLike[str] | None,
    suffix: str = "",
) -> IntegrityError | None:
    """``None`` when ``actual_bytes == expected_bytes``, else ``error`` (to raise) saying
    ``"<what> is <actual> bytes, expected <expected> (truncated|extended)<suffix>"``, naming ``file``."""
    if actual_bytes == expected_bytes:
        return None
    state = "truncated" if actual_bytes < expected_bytes else "extended"
    return error(f"{what} is {actual_bytes} bytes, expected {expected_bytes} ({state}){suffix}", file=file)


class ResidualDigestMismatchError(IntegrityError, rule="residual-sha256"):
    """The residual blob's SHA-256 differs from the manifest's."""

    remedy = _REPULL


class MissingObjectError(ColdsnapError, rule="object-present"):
    """A pack, residual blob, manifest or descriptor that should exist does not."""

    exit_code = EXIT_MISSING


class PayloadUnavailableError(MissingObjectError, _RedactedMessage, rule="payload-available"):
    """No source (node-local cache, payload store) can provide a worker's pack."""

    remedy = (
        "stage the pack on this node (`coldsnap stage ARTIFACT --repo STORE`), or set COLDSNAP_PAYLOAD_REPO to the store"
        " that holds it"
    )


class InvalidDigestError(ColdsnapError, rule="digest-form"):
    """A digest is not 64 lowercase hexadecimal characters; raised before any path is built from it."""


class UnsafePathError(ColdsnapError, rule="no-symlinks"):
    """A cache path (object, record, lock, folder) is a symbolic link or not a regular file."""


class CacheError(ColdsnapError, rule="cache"):
    """The node-local cache could not complete an operation (I/O error, lock timeout)."""


class InsufficientSpaceError(CacheError, rule="space"):
    """A write ran out of space (ENOSPC, EDQUOT) or hit the file size limit (EFBIG); nothing was kept."""


class LockTimeoutError(CacheError, rule="lock-timeout"):
    """A reader waited the lock timeout (``COLDSNAP_LOCK_TIMEOUT``) for a lock that a live process holds."""

    remedy = "wait for the process named above to release the lock, or raise COLDSNAP_LOCK_TIMEOUT"


class PackInUseError(CacheError, rule="pack-in-use"):
    """A pack a running load holds (its use file's shared ``flock``, ``docs/format.md`` §10) was not removed."""


class ValidationRecordError(CacheError, rule="validation-record"):
    """A validation record exists but cannot be trusted (loose mode, other owner, edited field)."""


class StoreError(_RedactedMessage, rule="payload-store"):
    """A payload store (local folder, Hugging Face repository) failed."""

    remedy = "check the store reference (its scheme, bucket and prefix) and that this node reaches the store"


class ArtifactError(ColdsnapError, rule="artifact"):
    """An artifact folder is inconsistent (e.g. a capsule that the descriptor does not list)."""


class ConfigurationError(ColdsnapError, rule="configuration"):
    """An environment variable, extra-config key or CLI option has an unsupported value."""

    remedy = 'correct or unset the setting named here (README, "Using it with vLLM": every setting and its values)'


class EngineVersionError(ConfigurationError, rule="engine-version"):
    """The installed inference engine (vLLM, SGLang) is a version coldsnap does not support."""

    remedy = 'install an engine version this coldsnap supports (README, "Install"), or a coldsnap release that supports this one'


class CopyBackendError(ColdsnapError, rule="copy"):
    """A copy backend failed to move bytes (I/O error, short read, device error)."""


class ObserverError(ColdsnapError, rule="observer"):
    """The write observer saw something it cannot classify safely."""


class WakeError(ColdsnapError, rule="wake"):
    """A level-1 wake could not hydrate every weights segment; the next wake starts over."""


class ModelIdentityMismatchError(ManifestError, rule="model-identity"):
    """The engine is loading another model than the artifact was captured from (``docs/format.md`` §10.1)."""

    remedy = "serve the model (checkpoint, revision, engine flags) the artifact was exported from, or export it again"


class ManifestMismatchError(ArtifactError, rule="manifests-agree"):
    """Two documents of one artifact disagree (``docs/format.md`` §7 rule 28)."""

    exit_code = EXIT_MANIFEST


class ManifestExtentDigestError(ManifestError, rule="manifest-extent-sha256"):
    """A model extent's recorded SHA-256 does not match an intact pack (its file SHA-256 matches its name): the
    manifest is wrong, the pack is kept (else :class:`ExtentDigestMismatchError`)."""


class ManifestPaddingError(ManifestError, rule="manifest-pack-padding"):
    """The manifest puts padding where an intact pack (its file SHA-256 matches its name) holds a non-zero byte:
    the manifest is wrong, the pack is kept (else :class:`NonZeroPaddingError`)."""


class NotRegularFileError(UnsafePathError, rule="regular-file"):
    """A path that must hold a regular file holds a folder, device, socket or other non-regular file."""


class FileAccessError(ColdsnapError, rule="io"):
    """A file or folder could not be opened, read, listed or written (``EACCES``, ``EIO``, ``EROFS``, ...)."""


class CapsulePinMismatchError(ManifestError, rule="capsule-pin"):
    """A capsule file does not match its pin in ``artifact.json`` (``docs/format.md`` §5, §7 rule 40)."""

    remedy = (
        "the artifact was changed after its export: pull it again (coldsnap pull REF DIR) or copy it again from where"
        " it was published, or export it again"
    )


class TargetMismatchError(ColdsnapError, rule="target-qualification"):
    """The capsule's residual was captured on another target and nothing of this node qualifies it
    (``docs/format.md`` §15.2); ``differences``: ``(field, captured, current)`` per differing qualifying field."""

    exit_code = EXIT_TARGET
    remedy = (
        "export the artifact on this target (`coldsnap export`), or capture a target-local overlay on this node"
        " (COLDSNAP_OVERLAY=capture: one checkpoint load)"
    )

    def __init__(self, detail: str, *, differences: tuple[tuple[str, object, object], ...] = (), **kwargs) -> None:
        self.differences = differences
        super().__init__(detail, **kwargs)


class OverlayError(ArtifactError, rule="overlay"):
    """A target-local overlay capture does not belong to its portable capsule (``docs/format.md`` §15.3)."""

    exit_code = EXIT_MANIFEST


class CheckpointAbsentError(ColdsnapError, rule="checkpoint-absent"):
    """A restore failed and the model folder holds no checkpoint weights to fall back to (``docs/format.md`` §10.1)."""


class ExportError(ColdsnapError, rule="export"):
    """``coldsnap export`` could not capture every worker (the engine exited, a worker refused, a timeout)."""


__all__ = sorted(
    [name for name, value in globals().items() if isinstance(value, type) and issubclass(value, ColdsnapError) and name[0] != "_"]
    + ["redact_store_spec", "size_mismatch"]
)
