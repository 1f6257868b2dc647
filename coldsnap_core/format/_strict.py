"""Strict JSON field access for the format documents.

Every document is parsed through :class:`Fields`, which refuses missing, mistyped and unknown keys,
booleans where integers are expected, negative numbers and numbers that do not fit a signed 64-bit
byte offset. Before that, :func:`parse_document` refuses what is not strict JSON: invalid UTF-8,
``NaN``/``Infinity``, nesting deeper than the parser's recursion limit, and an object that repeats a
key (JSON leaves the meaning open; two readers could disagree). Errors name the JSON path
(``model_extents[3].offset_bytes``) and the file.

Error classes (``coldsnap_core.errors``, all exit code 2): :class:`ManifestParseError` (not JSON),
:class:`ManifestSchemaError` (missing, unknown, repeated or mistyped key; wrong document kind),
:class:`UnsupportedFormatVersionError` (``format_version`` is not 9), :class:`ManifestValueError`
(a value out of range or of the wrong form).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from coldsnap_core._io import os_error
from coldsnap_core.errors import (
    ManifestParseError,
    ManifestSchemaError,
    ManifestValueError,
    MissingObjectError,
    NotRegularFileError,
    UnsupportedFormatVersionError,
)

T = TypeVar("T")

FORMAT_VERSION = 9
"""The only artifact format version this release writes and reads (``docs/format.md`` §15, "Versioning")."""

MAX_OFFSET_BYTES = (1 << 63) - 1
"""Largest byte offset or size accepted anywhere (signed 64-bit, as in safetensors and ``off_t``)."""

_SHA256_RE = re.compile(r"[0-9a-f]{64}")


class Fields:
    """A cursor over one JSON object that hands out typed fields and rejects the rest.

    Call :meth:`done` after reading every expected key: any key left over is an unknown field and
    raises :class:`~coldsnap_core.errors.ManifestSchemaError`.
    """

    __slots__ = ("_file", "_index", "_obj", "_parent", "_plain", "_seen")

    def __init__(self, obj: Any, where: str, file: str | None, *, index: int | None = None) -> None:
        # A manifest holds thousands of objects and most are never named in an error: the JSON path of
        # a list item is kept as (the list's path, the index) and written out only when an error needs it.
        self._parent = where
        self._index = index
        self._file = file
        if type(obj) is not dict and not isinstance(obj, Mapping):
            raise ManifestSchemaError(f"{self._where or 'document'} must be a JSON object, got {type(obj).__name__}", file=file)
        self._obj = obj
        self._seen: set[str] = set()
        # True only on a document's root whose text holds no ``true``, ``false`` or float (set by parse_document):
        # there Python's ``==`` between parsed values is JSON equality (``1 == True == 1.0`` cannot arise).
        self._plain = False

    @property
    def _where(self) -> str:
        return self._parent if self._index is None else f"{self._parent}[{self._index}]"

    def _path(self, key: str) -> str:
        where = self._where
        return f"{where}.{key}" if where else key

    def _get(self, key: str) -> Any:
        self._seen.add(key)
        if key not in self._obj:
            raise ManifestSchemaError(f"missing field {self._path(key)}", file=self._file)
        return self._obj[key]

    @property
    def raw(self) -> Mapping[str, Any]:
        """The JSON object this cursor reads (as parsed, before any field check)."""
        return self._obj

    def same_as(self, key: str, other: Any) -> bool:
        """Whether field ``key`` holds exactly the JSON value ``other``, so that ``1``, ``1.0`` and
        ``true`` differ, as they do to the typed getters. Marks ``key`` read.

        ``other`` must hold no ``true``, ``false`` or float: another document's field that the typed
        getters already accepted as integers, strings, ``null``, lists and objects. Then, in a
        document without those (``_plain``), Python's ``==`` decides (0.4 ms for a SmolLM2 allocation map);
        otherwise both are compared as compact JSON text (7 ms).

        Raises:
            ManifestSchemaError: ``key`` is missing.
        """
        value = self._get(key)
        if value is other:
            return True
        if self._plain:
            return bool(value == other)
        return json.dumps(value, separators=(",", ":")) == json.dumps(other, separators=(",", ":"))

    def has(self, key: str) -> bool:
        return key in self._obj

    def str(self, key: str, *, pattern: re.Pattern[str] | None = None, allow_empty: bool = False) -> str:
        value = self._get(key)
        if type(value) is str and value and pattern is None:  # the common case
            return value
        if not isinstance(value, str):
            raise ManifestSchemaError(f"field {self._path(key)} must be a string, got {type(value).__name__}", file=self._file)
        if not allow_empty and not value:
            raise ManifestValueError(f"field {self._path(key)} must not be empty", file=self._file)
        if pattern is not None and not pattern.fullmatch(value):
            raise ManifestValueError(f"field {self._path(key)}={value!r} does not match {pattern.pattern}", file=self._file)
        return value

    def opt_str(self, key: str) -> str | None:
        if self._obj.get(key, None) is None:
            self._get(key)  # still required to be present
            return None
        return self.str(key)

    def sha256(self, key: str) -> str:
        return self.str(key, pattern=_SHA256_RE)

    def opt_sha256(self, key: str) -> str | None:
        """A SHA-256 digest (64 lowercase hex characters) or ``null``; the key must be present."""
        if self._obj.get(key, None) is None:
            self._get(key)
            return None
        return self.sha256(key)

    def bool(self, key: str) -> bool:
        value = self._get(key)
        if not isinstance(value, bool):
            raise ManifestSchemaError(
                f"field {self._path(key)} must be true or false, got {type(value).__name__}", file=self._file
            )
        return value

    def int(self, key: str, *, minimum: int = 0, maximum: int = MAX_OFFSET_BYTES) -> int:
        self._seen.add(key)
        value = self._obj.get(key, _MISSING)
        if type(value) is int and minimum <= value <= maximum:  # the common case, without building a path
            return value
        return self._check_int(self._get(key), self._path(key), minimum, maximum)

    def opt_int(self, key: str, *, minimum: int = 0, maximum: int = MAX_OFFSET_BYTES) -> int | None:
        value = self._get(key)
        if value is None:
            return None
        return self._check_int(value, self._path(key), minimum, maximum)

    def _check_int(self, value: Any, path: str, minimum: int, maximum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ManifestSchemaError(f"field {path} must be an integer, got {type(value).__name__}", file=self._file)
        if value < minimum:
            raise ManifestValueError(f"field {path}={value} is below the minimum {minimum}", file=self._file)
        if value > maximum:
            raise ManifestValueError(f"field {path}={value} overflows the maximum {maximum}", file=self._file)
        return value

    def int_tuple(self, key: str, *, minimum: int = 0) -> tuple[int, ...]:
        items = self._get(key)
        if not isinstance(items, list):
            raise ManifestSchemaError(f"field {self._path(key)} must be a list, got {type(items).__name__}", file=self._file)
        if all(type(v) is int and minimum <= v <= MAX_OFFSET_BYTES for v in items):  # the common case
            return tuple(items)
        return tuple(self._check_int(v, f"{self._path(key)}[{i}]", minimum, MAX_OFFSET_BYTES) for i, v in enumerate(items))

    def obj(self, key: str, parse: Callable[[Fields], T]) -> T:
        return parse(Fields(self._get(key), self._path(key), self._file))

    def opt_obj(self, key: str, parse: Callable[[Fields], T]) -> T | None:
        if self._get(key) is None:
            return None
        return self.obj(key, parse)

    def list(self, key: str, parse: Callable[[Fields], T], *, fast: Callable[[Any], T | None] | None = None) -> tuple[T, ...]:
        """The list at ``key``, each item parsed with ``parse``.

        Args:
            fast: for lists of thousands of items (allocations, extents): takes one item's JSON value and
                returns its parsed form when the item passes every rule of ``parse``, else ``None``; the
                item is then parsed by ``parse``, which raises the error naming its JSON path. It must
                never accept an item ``parse`` refuses (``tests/core/test_strict_fast_paths.py``).
        """
        items = self._get(key)
        if not isinstance(items, list):
            raise ManifestSchemaError(f"field {self._path(key)} must be a list, got {type(items).__name__}", file=self._file)
        path = self._path(key)
        file = self._file
        if fast is None:
            return tuple([parse(Fields(item, path, file, index=i)) for i, item in enumerate(items)])
        parsed = []
        for i, item in enumerate(items):
            value = fast(item)
            parsed.append(parse(Fields(item, path, file, index=i)) if value is None else value)
        return tuple(parsed)

    def header(self, kind: str) -> None:
        """Check the ``format`` and ``format_version`` keys every document starts with."""
        found = self.str("format")
        if found != kind:
            raise ManifestSchemaError(f"document kind is {found!r}, expected {kind!r}", file=self._file)
        version = self._get("format_version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ManifestSchemaError(f"format_version must be an integer, got {version!r}", file=self._file)
        if version != FORMAT_VERSION:
            raise UnsupportedFormatVersionError(
                f"{kind} declares format_version {version}; this release reads only {FORMAT_VERSION}", file=self._file
            )

    def done(self) -> None:
        if self._seen.issuperset(self._obj):
            return
        unknown = sorted(set(self._obj) - self._seen)
        if unknown:
            raise ManifestSchemaError(f"unknown field(s) {', '.join(self._path(k) for k in unknown)}", file=self._file)

    def error(self, detail: str) -> ManifestValueError:
        """A :class:`ManifestValueError` located at this object."""
        return ManifestValueError(f"{self._where or 'document'}: {detail}", file=self._file)


def offset_tuple(values: Any) -> tuple[int, ...] | None:
    """``values`` as a tuple when it is a JSON list of integers in [0, :data:`MAX_OFFSET_BYTES`] (a shape,
    a stride), else ``None``: the fast paths' form of :meth:`Fields.int_tuple`."""
    if type(values) is not list:
        return None
    for value in values:
        if type(value) is not int or value < 0 or value > MAX_OFFSET_BYTES:
            return None
    return tuple(values)


def is_offset(value: Any, minimum: int = 0) -> bool:
    """Whether ``value`` passes :meth:`Fields.int` (an ``int``, not a ``bool``, in [``minimum``,
    :data:`MAX_OFFSET_BYTES`]); for the fast paths."""
    return type(value) is int and minimum <= value <= MAX_OFFSET_BYTES


def is_sha256(value: Any) -> bool:
    """Whether ``value`` passes :meth:`Fields.sha256` (64 lowercase hex characters); for the fast paths."""
    return type(value) is str and _SHA256_RE.fullmatch(value) is not None


_MISSING = object()
"""A default that no JSON value equals (:meth:`Fields.int`'s fast path)."""


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)  # built in C; a repeated key is the only way the dict ends up shorter than the pairs
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:  # only on the error path: name the first key that repeats
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return obj


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_document(text: str | bytes, parse: Callable[[Fields], T], *, file: str | None = None) -> T:
    """Parse one JSON document strictly with ``parse``; see :class:`Fields`.

    Raises:
        ManifestParseError: not UTF-8 JSON (``NaN`` and ``Infinity`` included), or nested too deeply.
        ManifestSchemaError: an object repeats a key (JSON leaves that undefined; coldsnap refuses it),
            or any :class:`Fields` rule.
        ManifestValueError / UnsupportedFormatVersionError: see :class:`Fields`.
    """
    if isinstance(text, bytes | bytearray | memoryview):
        data = bytes(text)
        if data.startswith(b"\xef\xbb\xbf"):
            raise ManifestParseError("not UTF-8 JSON: it starts with a byte-order mark", file=file)
        try:
            # json.loads(bytes) would also take UTF-16 and UTF-32 (and lone surrogates, 'surrogatepass')
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ManifestParseError(f"not UTF-8 JSON: {exc}", file=file) from None
    floats: list[str] = []

    def parse_float(number: str) -> float:
        floats.append(number)
        return float(number)

    try:
        raw = json.loads(text, object_pairs_hook=_refuse_duplicate_keys, parse_constant=_refuse_constant, parse_float=parse_float)
    except _DuplicateKey as exc:
        raise ManifestSchemaError(f"an object repeats the key {exc.key!r}", file=file) from exc
    except (ValueError, RecursionError) as exc:
        raise ManifestParseError(f"not valid JSON: {exc}", file=file) from exc
    if _SURROGATE_ESCAPE.search(text):  # only then can a string hold a lone surrogate (not Unicode, not UTF-8)
        _refuse_lone_surrogates(raw, file)
    root = Fields(raw, "", file)
    # "true" or "false" anywhere (inside a string too) counts: a cheap, conservative test for a boolean.
    root._plain = not floats and "true" not in text and "false" not in text
    return parse(root)


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate (``\\ud800``-``\\udfff``): a pair is one character, a lone one is not text."""


def _refuse_lone_surrogates(value: Any, file: str | None) -> None:
    """Raise ``ManifestParseError`` when a key or string of ``value`` holds a lone surrogate, which no UTF-8
    writer can write back (``inspect`` crashed on one with ``UnicodeEncodeError``)."""
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


def read_document(path: str | Path, parse: Callable[[Fields], T], *, max_bytes: int | None = None) -> T:
    """Read and strictly parse the JSON document at ``path``.

    Raises:
        MissingObjectError: the file does not exist.
        NotRegularFileError / FileAccessError: a folder at ``path``, or it cannot be read.
        ManifestError: any parse or schema failure (see :class:`Fields`).
    """
    path = Path(path)
    return parse_document(read_document_bytes(path, max_bytes=max_bytes), parse, file=str(path))


MAX_DESCRIPTOR_BYTES = 8 << 20
"""The largest ``artifact.json`` coldsnap reads (8 MiB; ``docs/format.md`` §4). It is the one document no
pin bounds (manifests are read only at the size ``artifact.json`` pins), and Python's JSON parser needs about
30 times a document's size in memory, so the cap bounds what a hostile descriptor costs each reader and rank
(about 250 MiB). A descriptor takes under 1 KiB per worker: 8 MiB fits about 10,000 workers."""

MAX_DOCUMENT_BYTES = 256 << 20
"""The largest JSON document coldsnap reads (256 MiB; ``docs/format.md`` §4). A manifest takes a few
hundred bytes per tensor and extent (SmolLM2-135M: about 200 KiB), so this leaves room for models with
hundreds of thousands of tensors while bounding what a hostile file can make a reader allocate."""


def read_document_bytes(path: Path, *, check_size: Callable[[int], None] | None = None, max_bytes: int | None = None) -> bytes:
    """The bytes of a document file, read through one descriptor that is checked before any read.

    Anything but a regular file (``stat``, following links) is refused before it is opened; the file
    is opened with ``O_NONBLOCK`` (so a named pipe swapped in cannot block the open) and refused unless
    ``fstat`` says it is a regular file, and its size is checked (``check_size``, then
    :data:`MAX_DOCUMENT_BYTES`) before anything is read; at most that many bytes plus one are read.

    Args:
        path: the document.
        check_size: called with the file's size in bytes before it is read (for a pinned manifest:
            raise if it is not the pinned size).

    Raises:
        MissingObjectError: the file does not exist.
        NotRegularFileError: a folder, named pipe, device or socket at ``path`` (rule ``regular-file``).
        FileAccessError: it cannot be opened or read (:func:`coldsnap_core._io.os_error`).
        ManifestParseError: it is larger than :data:`MAX_DOCUMENT_BYTES`.
    """
    try:
        # stat first: opening a socket fails with ENXIO and a terminal may block or take control.
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(f"document is not a regular file ({stat.filemode(mode)})", file=path)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError as exc:
        raise MissingObjectError("document does not exist", file=path) from exc
    except OSError as exc:
        raise os_error("document cannot be read", exc, path) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(f"document is not a regular file ({stat.filemode(st.st_mode)})", file=path)
        if check_size is not None:
            check_size(st.st_size)
        cap = MAX_DOCUMENT_BYTES if max_bytes is None else min(max_bytes, MAX_DOCUMENT_BYTES)
        if st.st_size > cap:
            raise ManifestParseError(
                f"document is {st.st_size} bytes, more than the {cap} bytes a coldsnap document of its kind may have",
                file=path,
            )
        limit = st.st_size + 1
        chunks = []
        while limit > 0:
            chunk = os.read(fd, min(limit, 8 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            limit -= len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise os_error("document cannot be read", exc, path) from exc
    finally:
        os.close(fd)


def dump_document(obj: Mapping[str, Any]) -> bytes:
    """Serialize a document deterministically: sorted keys, two-space indent, UTF-8, final newline.

    The bytes are exactly ``json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\\n"``
    (``docs/format.md`` §4). CPython's C encoder does not indent, and its pure-Python indenting
    encoder took 30 ms of a 360 ms SmolLM2 capture for the two manifests; :func:`_indented` writes
    the same text in about half the time. A value outside what the documents hold (``str``, ``int``,
    ``bool``, ``None``, lists, tuples and dicts with ``str`` keys) falls back to ``json.dumps``.
    """
    try:
        text = _indented(obj)
    except (_NotPlainJSON, RecursionError):  # json.dumps then gives its own result or error (a cycle: ValueError)
        text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False)
    return (text + "\n").encode("utf-8")


class _NotPlainJSON(Exception):
    """A value :func:`_indented` leaves to ``json.dumps`` (a float, a non-str key, another type)."""


def _indented(document: Any) -> str:
    """``json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False)`` for plain documents.

    Raises:
        _NotPlainJSON: ``document`` holds a value other than ``str``, ``int`` (not a subclass),
            ``True``/``False``/``None``, a list or tuple, or a dict whose keys are all ``str``.
    """
    parts: list[str] = []
    append = parts.append
    quote = json.encoder.encode_basestring  # the encoder json.dumps uses with ensure_ascii=False

    def encode(value: Any, indent: str) -> None:
        kind = type(value)
        if kind is str:
            append(quote(value))
        elif kind is int:
            append(int.__repr__(value))
        elif value is None or value is True or value is False:
            append("null" if value is None else "true" if value else "false")
        elif kind is dict:
            if not value:
                append("{}")
                return
            if any(type(key) is not str for key in value):
                raise _NotPlainJSON
            inner = indent + "  "
            separator = "{\n" + inner
            for key in sorted(value):
                append(separator)
                append(quote(key))
                append(": ")
                encode(value[key], inner)
                separator = ",\n" + inner
            append("\n" + indent + "}")
        elif kind is list or kind is tuple:
            if not value:
                append("[]")
                return
            inner = indent + "  "
            if all(type(item) is int for item in value):  # shapes, strides: one short line each
                append("[\n" + inner + (",\n" + inner).join(map(int.__repr__, value)) + "\n" + indent + "]")
                return
            separator = "[\n" + inner
            for item in value:
                append(separator)
                encode(item, inner)
                separator = ",\n" + inner
            append("\n" + indent + "]")
        else:
            raise _NotPlainJSON

    encode(document, "")
    return "".join(parts)
