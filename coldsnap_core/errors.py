"""The one exception hierarchy of coldsnap.

Every failure that coldsnap detects is raised as a subclass of :class:`ColdsnapError`. Each class names
the *rule* it enforces (a short stable identifier, listed in ``docs/format.md``) and carries the
context that failed: the file, the allocation index, the byte offset. The message always spells
those out, so a log line alone says what was refused and why::

    coldsnap: rule extent-sha256 failed: model extent 17 does not match its SHA-256 (expected 3f2a..., got 9be1...)
        [file=/cache/model-payloads/sha256/ab..cd.pack, allocation=12, offset_bytes=4096]

Each class also has an ``exit_code``: the code ``coldsnap verify`` (and every other CLI command) exits
with when that error stops it (``docs/format.md``, "Exit codes"):

====  =========================================================
code  meaning
====  =========================================================
0     verified
1     content mismatch or corruption (:class:`IntegrityError`)
2     malformed or unsupported manifest (:class:`ManifestError`)
3     missing object (:class:`MissingObjectError`)
4     any other error
5     the capsule is intact but not qualified for this target (:class:`TargetMismatchError`)
====  =========================================================
"""

from __future__ import annotations

import re
from os import PathLike

__all__ = [
    "AllocationSizeMismatchError",
    "ArtifactError",
    "CacheError",
    "CapsulePinMismatchError",
    "CheckpointAbsentError",
    "ColdsnapError",
    "ConfigurationError",
    "CopyBackendError",
    "CoverageGapError",
    "EngineVersionError",
    "ExportError",
    "ExtentBoundsError",
    "ExtentDigestMismatchError",
    "ExtentOrderError",
    "ExtentOverlapError",
    "FileAccessError",
    "InsufficientSpaceError",
    "IntegrityError",
    "InvalidDigestError",
    "LayoutMismatchError",
    "LockTimeoutError",
    "ManifestError",
    "ManifestExtentDigestError",
    "ManifestMismatchError",
    "ManifestPaddingError",
    "ManifestParseError",
    "ManifestSchemaError",
    "ManifestValueError",
    "MissingObjectError",
    "ModelIdentityMismatchError",
    "NonZeroPaddingError",
    "NotRegularFileError",
    "ObserverError",
    "OverlayError",
    "PackDigestMismatchError",
    "PackInUseError",
    "PackLayoutError",
    "PackPathMismatchError",
    "PackSizeMismatchError",
    "PayloadUnavailableError",
    "ResidualDigestMismatchError",
    "ResidualLayoutError",
    "ResidualSizeMismatchError",
    "StoreError",
    "TargetMismatchError",
    "UnsafePathError",
    "UnsupportedFormatVersionError",
    "ValidationRecordError",
    "WakeError",
    "redact_store_spec",
    "size_mismatch",
]

EXIT_VERIFIED = 0
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
    """Base class of every error coldsnap raises.

    Args:
        detail: what was found, in words (the rule is prepended automatically).
        file: the file (pack, blob, manifest, record, lock) the failure concerns, if any.
        allocation: the allocation index the failure concerns, if any.
        offset_bytes: the byte offset (within the allocation, or within ``file`` when no allocation
            is named) where the failure was detected, if any.
        remedy: the one thing an operator should do about it, in their terms (an engine flag, a command), if
            this raise site knows better than the class's own ``remedy``.

    Attributes:
        rule: stable identifier of the violated rule (see ``docs/format.md``).
        exit_code: the CLI exit code for this error.
        remedy: what to do, or ``None``; the message ends with ``; remedy: <remedy>`` when there is one.
    """

    rule: str = "coldsnap"
    exit_code: int = EXIT_OTHER
    remedy: str | None = None

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
        """Name ``names[old]`` wherever this error names ``old`` (its ``file`` and its detail); returns ``self``.

        Hydration reads through ``/proc/self/fd/<n>`` names (:func:`coldsnap_core.format.verify.pinned_file`); an
        error raised on one must still name the real file.
        """
        for old, new in names.items():
            if self.file == old:
                self.file = new
            self.detail = self.detail.replace(old, new)
        self.args = (self._compose(),)
        return self

    def with_remedy(self, remedy: str) -> ColdsnapError:
        """Set this error's remedy to ``remedy`` (a raise site that knows the operator's values: the artifact, the
        store); returns ``self``."""
        self.remedy = remedy
        self.args = (self._compose(),)
        return self

    def _compose(self) -> str:
        context = []
        if self.file is not None:
            context.append(f"file={self.file}")
        if self.allocation is not None:
            context.append(f"allocation={self.allocation}")
        if self.offset_bytes is not None:
            context.append(f"offset_bytes={self.offset_bytes}")
        suffix = f" [{', '.join(context)}]" if context else ""
        remedy = f"; remedy: {self.remedy}" if self.remedy else ""
        return f"rule {self.rule} failed: {self.detail}{suffix}{remedy}"


_SECRET_VALUE = re.compile(r"(?i)\b(AccountKey|SharedAccessSignature|sig|X-Amz-Signature|X-Goog-Signature)=([^;&\s'\"]*)")
_URL_USERINFO = re.compile(r"(://)[^/\s'\"]*@")
# a URL's query string or fragment (a SAS token, a presigned signature): everything after '?' or '#' up to a quote
# or a space. Store URLs refuse both (docs/format.md §12), so only a message quoting a refused value shows one.
_URL_QUERY = re.compile(r"(://[^?#\s'\"]*)[?#][^\s'\"]*")


def redact_store_spec(text: str) -> str:
    """``text`` (a store setting, or a message quoting one) with its secrets replaced by ``***``: the values of
    an Azure connection string's ``AccountKey`` and ``SharedAccessSignature`` (and a SAS ``sig``, a presigned
    ``X-Amz-Signature`` / ``X-Goog-Signature``), the ``user:password@`` of a URL, and a URL's query string or
    fragment. Every message that quotes a store setting goes through this, and so does every
    :class:`StoreError` and :class:`PayloadUnavailableError` (their detail and file)."""
    text = _SECRET_VALUE.sub(r"\1=***", text)
    text = _URL_USERINFO.sub(r"\1***@", text)
    return _URL_QUERY.sub(r"\1?***", text)


class _RedactedMessage(ColdsnapError):
    """An error whose detail and file may quote a store's name or an object's location: both go through
    :func:`redact_store_spec` (a store built from a setting with a secret never shows it in an error)."""

    def __init__(self, detail: str, *, file: str | PathLike[str] | None = None, **kwargs: int | str | None) -> None:
        super().__init__(redact_store_spec(detail), file=None if file is None else redact_store_spec(str(file)), **kwargs)


# --- 2: malformed or unsupported manifests --------------------------------------------------------


class ManifestError(ColdsnapError):
    """A manifest, descriptor or record is malformed, unsupported or internally inconsistent."""

    rule = "manifest"
    exit_code = EXIT_MANIFEST
    remedy = _REPULL


class ManifestParseError(ManifestError):
    """The file is not valid UTF-8 JSON."""

    rule = "manifest-json"


class ManifestSchemaError(ManifestError):
    """A field is missing, mistyped or unknown, or the document kind is wrong."""

    rule = "manifest-schema"


class UnsupportedFormatVersionError(ManifestError):
    """The document declares a format version this release does not read (only 9 is read)."""

    rule = "format-version"


class ManifestValueError(ManifestError, ValueError):
    """A numeric field is negative, overflows a signed 64-bit offset, a string has a bad form, or a rule across a
    document's fields fails. Also a ``ValueError``: a format type's ``__post_init__`` raises it, which refuses to build
    such a document and lets msgspec name the object's JSON path when one is read."""

    rule = "manifest-value"


class ExtentBoundsError(ManifestError):
    """An extent lies (partly) outside its allocation, or names an allocation that does not exist."""

    rule = "extent-within-allocation"


class ExtentOverlapError(ManifestError):
    """Two extents (model or residual, in any combination) cover the same allocation byte."""

    rule = "maps-disjoint"


class CoverageGapError(ManifestError):
    """Some byte of a preserved allocation is covered by neither the model nor the residual map."""

    rule = "maps-cover-allocation"


class PackLayoutError(ManifestError):
    """The model extent map does not describe a canonical pack.

    Canonical means: stored extents ordered by (SHA-256, size), each starting on a 4096-byte
    boundary right after the previous one's padding, identical extents stored once, and the file
    size equal to the end of the last extent rounded up to 4096 bytes.
    """

    rule = "pack-canonical-layout"


class ResidualLayoutError(ManifestError):
    """The residual extent map does not describe the blob: extents must be stored back to back, in
    map order, from offset 0, and their sizes must add up to the blob's ``size_bytes``."""

    rule = "residual-canonical-layout"


class ExtentOrderError(ManifestError):
    """An extent map is not sorted by (allocation_index, offset_bytes)."""

    rule = "extent-order"


class LayoutMismatchError(ManifestError):
    """The live allocations do not have the layout the manifest was captured from.

    Raised when the layout fingerprint (names, dtypes, shapes, strides, offsets and sizes) of the
    model being restored differs from the manifest's, e.g. a payload captured from another model,
    dtype or layer count, or when an allocation map no longer matches its recorded fingerprint.
    """

    rule = "layout-fingerprint"
    remedy = _SERVE_AS_CAPTURED


class AllocationSizeMismatchError(ManifestError):
    """A live allocation's size differs from the size recorded in the allocation map."""

    rule = "allocation-size"
    remedy = _SERVE_AS_CAPTURED


# --- 1: content mismatch or corruption -----------------------------------------------------------


class IntegrityError(ColdsnapError):
    """Bytes on disk (or in memory) do not match what the manifest or the digest promises."""

    rule = "integrity"
    exit_code = EXIT_INTEGRITY


class PackSizeMismatchError(IntegrityError):
    """The pack file's size differs from the manifest's ``size_bytes`` (a truncated or extended pack)."""

    rule = "pack-size"


class PackDigestMismatchError(IntegrityError):
    """The pack file's SHA-256 differs from the digest that names it."""

    rule = "pack-sha256"


class PackPathMismatchError(IntegrityError):
    """The pack's path is not ``model-payloads/sha256/<sha256>.pack`` for its recorded SHA-256."""

    rule = "pack-path"


class NonZeroPaddingError(IntegrityError):
    """A padding byte between (or after) pack extents is not zero."""

    rule = "pack-padding-zero"


class ExtentDigestMismatchError(IntegrityError):
    """A model extent's bytes do not match the extent's recorded SHA-256."""

    rule = "extent-sha256"


class ResidualSizeMismatchError(IntegrityError):
    """The residual blob's size differs from the manifest's (a truncated or extended blob)."""

    rule = "residual-size"
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
    """The one size check of a file (pack, blob, stored object): ``None`` when ``actual_bytes ==
    expected_bytes``, else ``error`` (e.g. :class:`PackSizeMismatchError`, to raise) with the message
    ``"<what> is <actual> bytes, expected <expected> (truncated|extended)<suffix>"`` naming ``file``."""
    if actual_bytes == expected_bytes:
        return None
    state = "truncated" if actual_bytes < expected_bytes else "extended"
    return error(f"{what} is {actual_bytes} bytes, expected {expected_bytes} ({state}){suffix}", file=file)


class ResidualDigestMismatchError(IntegrityError):
    """The residual blob's SHA-256 differs from the manifest's."""

    rule = "residual-sha256"
    remedy = _REPULL


# --- 3: missing objects ----------------------------------------------------------------------------


class MissingObjectError(ColdsnapError):
    """A pack, residual blob, manifest or descriptor that should exist does not."""

    rule = "object-present"
    exit_code = EXIT_MISSING


class PayloadUnavailableError(MissingObjectError, _RedactedMessage):
    """No source (node-local cache, payload store) can provide a worker's pack.

    ``COLDSNAP_RESTORE=auto`` falls back to the safetensors recovery load on this error.
    """

    rule = "payload-available"
    remedy = (
        "stage the pack on this node (`coldsnap stage ARTIFACT --repo STORE`), or set COLDSNAP_PAYLOAD_REPO to the store"
        " that holds it"
    )


# --- 4: everything else ----------------------------------------------------------------------------


class InvalidDigestError(ColdsnapError):
    """A digest is not 64 lowercase hexadecimal characters; raised before any path is built from it."""

    rule = "digest-form"


class UnsafePathError(ColdsnapError):
    """A cache path (object, record, lock, folder) is a symbolic link or not a regular file."""

    rule = "no-symlinks"


class CacheError(ColdsnapError):
    """The node-local cache could not complete an operation (I/O error, lock timeout)."""

    rule = "cache"


class InsufficientSpaceError(CacheError):
    """A write ran out of space (ENOSPC, EDQUOT) or hit the file size limit (EFBIG); nothing was kept."""

    rule = "space"


class LockTimeoutError(CacheError):
    """A reader waited the lock timeout (``COLDSNAP_LOCK_TIMEOUT``) for a lock that a live process holds."""

    rule = "lock-timeout"
    remedy = "wait for the process named above to release the lock, or raise COLDSNAP_LOCK_TIMEOUT"


class PackInUseError(CacheError):
    """A pack a running load holds (its use file's shared ``flock``, ``docs/format.md`` §10) was not removed."""

    rule = "pack-in-use"


class ValidationRecordError(CacheError):
    """A validation record exists but cannot be trusted (loose mode, other owner, edited field)."""

    rule = "validation-record"


class StoreError(_RedactedMessage):
    """A payload store (local folder, Hugging Face repository) failed."""

    rule = "payload-store"
    remedy = "check the store reference (its scheme, bucket and prefix) and that this node reaches the store"


class ArtifactError(ColdsnapError):
    """An artifact folder is inconsistent (e.g. a capsule that the descriptor does not list)."""

    rule = "artifact"


class ConfigurationError(ColdsnapError):
    """An environment variable, extra-config key or CLI option has an unsupported value."""

    rule = "configuration"
    remedy = 'correct or unset the setting named here (README, "Using it with vLLM": every setting and its values)'


class EngineVersionError(ConfigurationError):
    """The installed inference engine (vLLM, SGLang) is a version coldsnap does not support."""

    rule = "engine-version"
    remedy = 'install an engine version this coldsnap supports (README, "Install"), or a coldsnap release that supports this one'


class CopyBackendError(ColdsnapError):
    """A copy backend failed to move bytes (I/O error, short read, device error)."""

    rule = "copy"


class ObserverError(ColdsnapError):
    """The write observer saw something it cannot classify safely."""

    rule = "observer"


class WakeError(ColdsnapError):
    """A level-1 wake could not hydrate every weights segment; the next wake starts over."""

    rule = "wake"


class ModelIdentityMismatchError(ManifestError):
    """The engine is loading another model than the one the artifact was captured from.

    Compared before any payload byte is read (:func:`coldsnap_core.identity.model_identity.check_model_identity`):
    the model's source (Hugging Face repository id or local folder); for a repository its resolved
    commit; the engine's model configuration digest; for a local folder the checkpoint files the
    engine would read, every recorded file's name and size, and its SHA-256 where this node knows it: from
    a checkpoint record that still matches the file, by hashing a file that changed since its record,
    or by hashing every file without a record under ``COLDSNAP_VERIFY_CHECKPOINT=1``
    (``docs/format.md`` §10.1). A file without a record is otherwise accepted on its name and size.
    """

    rule = "model-identity"
    remedy = "serve the model (checkpoint, revision, engine flags) the artifact was exported from, or export it again"


class ManifestMismatchError(ArtifactError):
    """Two documents of one artifact disagree: a capsule's native and recovery manifests (worker,
    layout fingerprint, allocation map, residual blob or residual map), or ``artifact.json`` and a
    capsule's manifests (payload digest, size and path; model identity).

    An :class:`ArtifactError`, but an inconsistent manifest, so it exits with code 2
    (``docs/format.md``, "Exit codes": ``verify`` exits 2 on a malformed, unsupported or inconsistent
    manifest).
    """

    rule = "manifests-agree"
    exit_code = EXIT_MANIFEST


class ManifestExtentDigestError(ManifestError):
    """A model extent's recorded SHA-256 does not match the bytes the pack stores for it, while the
    pack file's own SHA-256 matches its name.

    The pack is then intact (it holds exactly the bytes its name promises) and the manifest is wrong
    about it: exit code 2, and the pack is not quarantined (other artifacts naming the same digest
    keep using it). A pack whose file SHA-256 differs from its name reports
    :class:`ExtentDigestMismatchError` (exit code 1) instead.
    """

    rule = "manifest-extent-sha256"


class ManifestPaddingError(ManifestError):
    """The manifest's layout puts padding where the pack holds a non-zero byte, while the pack file's
    own SHA-256 matches its name: the manifest's extent sizes do not describe this pack.

    Exit code 2; the pack is not quarantined. A pack whose file SHA-256 differs from its name reports
    :class:`NonZeroPaddingError` (exit code 1) instead.
    """

    rule = "manifest-pack-padding"


class NotRegularFileError(UnsafePathError):
    """A path that must hold a regular file (pack, residual blob, manifest, descriptor, record, store
    object) holds a folder, device, socket or other non-regular file. An :class:`UnsafePathError`
    (exit code 4) with its own rule, so a folder at ``weights.blob`` is not reported as a blob of the
    wrong size."""

    rule = "regular-file"


class FileAccessError(ColdsnapError):
    """A file or folder could not be opened, read, listed or written for a reason that says nothing
    about its content: permissions (``EACCES``), a symbolic link loop (``ELOOP``), an I/O error
    (``EIO``), a read-only file system, ... The message carries the operating system's reason."""

    rule = "io"


class CapsulePinMismatchError(ManifestError):
    """A capsule file does not match its pin in ``artifact.json``.

    ``artifact.json`` is the root of trust of an artifact: each worker entry pins the SHA-256 and
    size of both manifests and the residual blob of its capsule (``capsule_files``). A manifest
    edited in any byte (even so that it stays consistent with itself and with its pack), replaced by
    another worker's, or a pin that disagrees with the native manifest's ``residual`` is refused
    before the capsule is used. Exit code 2, like any other inconsistent manifest.
    """

    rule = "capsule-pin"
    exit_code = EXIT_MANIFEST
    remedy = (
        "the artifact was changed after its export: pull it again (coldsnap pull REF DIR) or copy it again from where"
        " it was published, or export it again"
    )


class TargetMismatchError(ColdsnapError):
    """The capsule's residual was captured on another target (``docs/format.md`` §15): a qualifying
    field of its ``target.json`` (engine, engine version, torch and its CUDA version, device type,
    accelerator model, NVIDIA driver) differs from the current worker's, and no target-local overlay
    or qualification record of this node covers the current target. The capsule itself is intact;
    ``COLDSNAP_RESTORE=auto`` loads the checkpoint, ``native`` stops here. Never raised for the pack:
    model bytes are target independent.

    Attributes:
        differences: ``(field, captured value, current value)`` for each differing qualifying field.
    """

    rule = "target-qualification"
    exit_code = EXIT_TARGET
    remedy = (
        "export the artifact on this target (`coldsnap export`), or capture a target-local overlay on this node"
        " (COLDSNAP_OVERLAY=capture: one checkpoint load)"
    )

    def __init__(self, detail: str, *, differences: tuple[tuple[str, object, object], ...] = (), **kwargs) -> None:
        self.differences = differences
        super().__init__(detail, **kwargs)


class OverlayError(ArtifactError):
    """A target-local overlay capture does not belong to its portable capsule (``docs/format.md``
    §15.3): another worker, or model payload objects whose owner, role, size or SHA-256 differ (it is
    not the same model). Nothing is stored. Exit code 2, like an inconsistent manifest."""

    rule = "overlay"
    exit_code = EXIT_MANIFEST


class CheckpointAbsentError(ColdsnapError):
    """A restore failed where the engine loads a model folder without the checkpoint's weights (the model's
    non-weight files only, ``docs/format.md`` §10.1): there is no checkpoint on this node to load instead, so the
    start stops (under ``COLDSNAP_RESTORE=auto`` too) rather than serve a model whose weights nothing filled. The
    message names the rule that failed and its message."""

    rule = "checkpoint-absent"


class ExportError(ColdsnapError):
    """``coldsnap export`` could not capture every worker: the engine exited, a worker refused (its outcome line's
    rule and detail), or the capture did not come within the timeout; the message names what happened and ends
    with the engine's last lines of output."""

    rule = "export"
