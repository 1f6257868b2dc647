"""The one codec of coldsnap's JSON documents (bytes, rules and error classes: ``docs/format.md`` §4).

A document type is a frozen :class:`msgspec.Struct` (:class:`Document`; its objects :class:`Record`) whose
``__post_init__`` holds the rules across fields, on read and on build. :func:`load_document` accepts at once a
document that is byte for byte what :func:`dump_document` writes for it; anything else is read again with Python's
``json`` to name what is wrong (a repeated key, invalid UTF-8, the header, msgspec's refusal with its JSON path, a
key the writer writes that is missing or one it leaves out that is present).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec

from coldsnap_core._io import open_regular, os_error
from coldsnap_core.digests import SHA256_HEX_RE
from coldsnap_core.errors import (
    ManifestError,
    ManifestParseError,
    ManifestSchemaError,
    ManifestValueError,
    UnsupportedFormatVersionError,
)

FORMAT_VERSION = 9
"""The only artifact format version this release writes and reads (``docs/format.md`` §16, "Versioning")."""

MAX_OFFSET_BYTES = (1 << 63) - 1
"""Largest byte offset or size accepted anywhere (signed 64-bit, as in safetensors and ``off_t``)."""

Offset = Annotated[int, msgspec.Meta(ge=0, le=MAX_OFFSET_BYTES)]
"""An integer in [0, :data:`MAX_OFFSET_BYTES`]: a byte offset or size, an index, a rank."""

Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_OFFSET_BYTES)]
"""An integer in [1, :data:`MAX_OFFSET_BYTES`]: a size that may not be 0 (an extent's, a world's)."""

Text = Annotated[str, msgspec.Meta(min_length=1)]
"""A non-empty string."""


def matching(regex: str) -> Any:
    """A string type whose values match ``regex`` as a whole (msgspec's ``pattern`` searches, so it is anchored)."""
    return Annotated[str, msgspec.Meta(pattern=rf"^(?:{regex})\Z")]


Sha256 = matching(SHA256_HEX_RE.pattern)
"""A SHA-256 digest: 64 lowercase hexadecimal characters."""

MAX_DESCRIPTOR_BYTES = 8 << 20
"""The largest ``artifact.json`` coldsnap reads (8 MiB, about 10,000 workers; ``docs/format.md`` §4)."""

MAX_DOCUMENT_BYTES = 256 << 20
"""The largest JSON document coldsnap reads (256 MiB; ``docs/format.md`` §4)."""


_ENCODER = msgspec.json.Encoder(order="sorted")


class Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A JSON object of a document: frozen, every field required in the JSON, no other key accepted."""

    def to_json(self) -> dict[str, Any]:
        """The JSON object this record is written as (keys as written, lists for tuples)."""
        return msgspec.json.decode(_ENCODER.encode(self))


class Document(Record, kw_only=True, tag_field="format"):
    """A :class:`Record` whose ``format`` key is its kind (the class's ``tag``) and ``format_version`` its version."""

    format_version: Literal[9] = FORMAT_VERSION

    MAX_BYTES: ClassVar[int] = MAX_DOCUMENT_BYTES
    """The largest file of this kind :meth:`read` reads."""

    def dumps(self) -> bytes:
        return dump_document(self)

    @classmethod
    def loads(cls: type[D], data: str | bytes, *, file: str | None = None) -> D:
        """Parse strictly (:func:`load_document`); raises a :class:`~coldsnap_core.errors.ManifestError` subclass."""
        return load_document(cls, data, file=file)

    @classmethod
    def read(cls: type[D], path: str | Path) -> D:
        """Read strictly (:func:`read_document`)."""
        return read_document(path, cls, max_bytes=cls.MAX_BYTES)


D = TypeVar("D", bound=Record)


def dump_document(document: Any) -> bytes:
    """The bytes of a :class:`Record` or plain JSON without floats (``docs/format.md`` §4)."""
    return msgspec.json.format(_ENCODER.encode(document), indent=2) + b"\n"


@functools.cache
def _decoder(kind: type[D]) -> msgspec.json.Decoder[D]:
    return msgspec.json.Decoder(kind)


def load_document(kind: type[D], data: str | bytes, *, file: str | None = None) -> D:
    """Parse one document of type ``kind`` strictly; raises the ``ManifestError`` subclasses of ``docs/format.md`` §4."""
    data = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    try:
        document = _decoder(kind).decode(data)
    except msgspec.DecodeError as exc:  # msgspec.ValidationError included
        document, refusal = None, exc
    else:
        if dump_document(document) == data:
            return document
        refusal = None
    raw = _parse_plain(data, file)
    _check_header(kind, raw, file)
    if refusal is not None:
        raise _manifest_error(refusal, raw, file) from None
    error = _spelling_error(document.to_json(), raw, "", file)
    if error is not None:
        raise error
    return document


def read_document(path: str | Path, kind: type[D], *, max_bytes: int | None = None) -> D:
    """Read (:func:`read_document_bytes`) and strictly parse (:func:`load_document`) the document at ``path``."""
    path = Path(path)
    return load_document(kind, read_document_bytes(path, max_bytes=max_bytes), file=str(path))


def _parse_plain(data: bytes, file: str | None) -> Any:
    """``data`` parsed by Python's ``json`` module, refusing what msgspec does not (or names less well)."""
    if data.startswith(b"\xef\xbb\xbf"):
        raise ManifestParseError("not UTF-8 JSON: it starts with a byte-order mark", file=file)
    try:
        # json.loads(bytes) would also take UTF-16 and UTF-32 (and lone surrogates, 'surrogatepass')
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestParseError(f"not UTF-8 JSON: {exc}", file=file) from None
    try:
        raw = json.loads(
            text, object_pairs_hook=functools.partial(_refuse_duplicate_keys, file=file), parse_constant=_refuse_constant
        )
    except (ValueError, RecursionError) as exc:
        raise ManifestParseError(f"not valid JSON: {exc}", file=file) from exc
    if _SURROGATE_ESCAPE.search(text):  # only then can a string hold a lone surrogate (not Unicode, not UTF-8)
        _refuse_lone_surrogates(raw, file)
    return raw


def _check_header(kind: type[Record], raw: Any, file: str | None) -> None:
    """The checks made before any other field: a JSON object, of ``kind``'s ``format``, then its ``format_version``."""
    if type(raw) is not dict:
        raise ManifestSchemaError(f"document must be a JSON object, got {type(raw).__name__}", file=file)
    expected_kind = kind.__struct_config__.tag
    expected_version = next(f.default for f in msgspec.structs.fields(kind) if f.name == "format_version")
    for key in ("format", "format_version"):
        if key not in raw:
            raise ManifestSchemaError(f"missing field {key}", file=file)
    if not isinstance(raw["format"], str):
        raise ManifestSchemaError(f"field format must be a string, got {type(raw['format']).__name__}", file=file)
    if raw["format"] != expected_kind:
        raise ManifestSchemaError(f"document kind is {raw['format']!r}, expected {expected_kind!r}", file=file)
    version = raw["format_version"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise ManifestSchemaError(f"format_version must be an integer, got {version!r}", file=file)
    if version != expected_version:
        raise UnsupportedFormatVersionError(
            f"{expected_kind} declares format_version {version}; this release reads only {expected_version}", file=file
        )


_REFUSAL = re.compile(r"(?P<what>.*?)(?: - at `\$\.?(?P<path>[^`]*)`)?", re.DOTALL)
"""A :class:`msgspec.ValidationError`'s message: what was refused, and where (``$.model_extents[3].size_bytes``)."""

_RULES: tuple[tuple[re.Pattern[str], type[ManifestError], str], ...] = tuple(
    (re.compile(pattern), error, message)
    for pattern, error, message in (
        (r"Object missing required field `(.*)`", ManifestSchemaError, "missing field {at}{0}"),
        (r"Object contains unknown field `(.*)`", ManifestSchemaError, "unknown field(s) {at}{0}"),
        (r"Expected `int` >= (.*)", ManifestValueError, "field {path}={value} is below the minimum {0}"),
        (r"Expected `int` <= (.*)", ManifestValueError, "field {path}={value} overflows the maximum {0}"),
        (r"Expected `str` of length >= 1", ManifestValueError, "field {path} must not be empty"),
        (r"Expected `str` matching regex '\^\(\?:(.*)\)\\\\Z'", ManifestValueError, "field {path}={value!r} does not match {0}"),
        (r"Invalid enum value .*", ManifestValueError, "field {path}={value!r} is not one of its values"),
        (r"Expected `(.*)`, got `(.*)`", ManifestSchemaError, "field {path} must be {expected}, got {1}"),
    )
)
"""msgspec's refusals as coldsnap's: (message pattern, class, message); anything else is a ManifestSchemaError."""


_JSON_TYPES = {"int": "an integer", "str": "a string", "bool": "true or false", "array": "a list", "object": "a JSON object"}
"""msgspec's names of the JSON types a field may hold, as the messages say them."""


def _manifest_error(refusal: msgspec.DecodeError, raw: Any, file: str | None) -> ManifestError:
    """The error a refusal of msgspec's is, naming the JSON path (``raw`` is the document, for the value)."""
    if not isinstance(refusal, msgspec.ValidationError):
        return ManifestParseError(f"not valid JSON: {refusal}", file=file)
    match = _REFUSAL.fullmatch(str(refusal))
    assert match is not None  # the pattern matches any text
    what, path = match["what"], match["path"] or ""
    if isinstance(refusal.__cause__, ManifestValueError):  # a __post_init__ rule
        return ManifestValueError(f"{path or 'document'}: {refusal.__cause__.detail}", file=file)
    for pattern, error, message in _RULES:
        found = pattern.fullmatch(what)
        if found is not None:
            expected = " or ".join(_JSON_TYPES.get(name, name) for name in found.group(1).split(" | ")) if found.groups() else ""
            details = {"path": path, "value": _value_at(raw, path), "at": f"{path}." if path else "", "expected": expected}
            return error(message.format(*found.groups(), **details), file=file)
    return ManifestSchemaError(f"field {path or 'document'}: {what}", file=file)


_PATH_STEP = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _value_at(raw: Any, path: str) -> Any:
    """The JSON value at ``path`` (``allocations[0].tag``) in ``raw``, for a message; ``None`` if there is none."""
    for key, index in _PATH_STEP.findall(path):
        try:
            raw = raw[int(index)] if index else raw[key]
        except (KeyError, IndexError, TypeError):
            return None
    return raw


def _spelling_error(written: Any, raw: Any, path: str, file: str | None) -> ManifestSchemaError | None:
    """A key :func:`dump_document` writes (``written``) that ``raw`` lacks, or one ``raw`` holds that it leaves out
    (§4.3's data parallel fields), as an error; ``None`` when there is neither."""
    if isinstance(written, dict):
        at = f"{path}." if path else ""
        missing = [key for key in written if key not in raw]
        if missing:
            return ManifestSchemaError(f"missing field {at}{missing[0]}", file=file)
        extra = [key for key in raw if key not in written]
        if extra:
            return ManifestSchemaError(f"field {at}{extra[0]} must be left out with these values", file=file)
        items = [(written[key], raw[key], f"{path}.{key}" if path else key) for key in written]
    elif isinstance(written, list):
        items = [(value, other, f"{path}[{i}]") for i, (value, other) in enumerate(zip(written, raw, strict=True))]
    else:
        return None
    for value, other, where in items:
        error = _spelling_error(value, other, where, file)
        if error is not None:
            return error
    return None


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]], file: str | None) -> dict[str, Any]:
    obj = dict(pairs)  # built in C; a repeated key is the only way the dict ends up shorter than the pairs
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:  # only on the error path: name the first key that repeats
            if key in seen:
                raise ManifestSchemaError(f"an object repeats the key {key!r}", file=file)
            seen.add(key)
    return obj


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate (``\\ud800``-``\\udfff``): a pair is one character, a lone one is not text."""


def _refuse_lone_surrogates(value: Any, file: str | None) -> None:
    """Raise ``ManifestParseError`` when a key or string of ``value`` holds a lone surrogate (not writable as UTF-8)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ManifestParseError(
                    f"not UTF-8 JSON: the string {item!r} holds a lone surrogate escape", file=file
                ) from None


def read_document_bytes(path: Path, *, check_size: Callable[[int], None] | None = None, max_bytes: int | None = None) -> bytes:
    """The bytes of a document file, through one descriptor (:func:`~coldsnap_core._io.open_regular`, links followed,
    and its errors) whose size is checked before any read: ``check_size(size)``, then ``max_bytes`` and
    :data:`MAX_DOCUMENT_BYTES` (``ManifestParseError``)."""
    with open_regular(path, "document", follow_links=True) as (fd, st):
        if check_size is not None:
            check_size(st.st_size)
        cap = MAX_DOCUMENT_BYTES if max_bytes is None else min(max_bytes, MAX_DOCUMENT_BYTES)
        if st.st_size > cap:
            raise ManifestParseError(
                f"document is {st.st_size} bytes, more than the {cap} bytes a coldsnap document of its kind may have",
                file=path,
            )
        try:
            with open(fd, "rb", closefd=False) as f:
                return f.read(st.st_size + 1)
        except OSError as exc:
            raise os_error("document cannot be read", exc, path) from exc
