"""The content fingerprint of a checkpoint file: a few MiB sampled from it (``docs/format.md`` §10.2),
cheap enough to re-check on every restore."""

from __future__ import annotations

import contextlib
import hashlib
import os

FINGERPRINT_DOMAIN = b"coldsnap-checkpoint-fingerprint-v1\n"


FINGERPRINT_BLOCK_BYTES = 128 * 1024


FINGERPRINT_BLOCK_COUNT = 16
"""The fingerprint samples ``FINGERPRINT_BLOCK_COUNT`` blocks of ``FINGERPRINT_BLOCK_BYTES`` (2 MiB in
all) from the data region of each checkpoint file (``docs/format.md`` §10.2)."""


_HEADER_LENGTH_BYTES = 8


_MAX_SAFETENSORS_HEADER_BYTES = 100_000_000  # safetensors' own cap (huggingface/safetensors README)


def fingerprint_ranges(size_bytes: int, header_length_bytes: int | None) -> list[tuple[int, int]]:
    """The ``(offset_bytes, size_bytes)`` ranges of a file that :func:`checkpoint_fingerprint` hashes, in order.

    Args:
        size_bytes: the file's size.
        header_length_bytes: the little-endian ``u64`` at offset 0 of a safetensors file (its JSON
            header's length ``N``), or ``None`` for a file too short to hold one.

    The header region is ``[0, 8 + N)`` when ``8 + N <= size_bytes`` and ``N <= 100,000,000``, else
    empty (not a safetensors file: a ``.bin`` or ``.pt`` checkpoint). The data region is the rest: hashed
    whole when it is at most ``FINGERPRINT_BLOCK_COUNT * FINGERPRINT_BLOCK_BYTES`` (2 MiB), else as
    ``FINGERPRINT_BLOCK_COUNT`` blocks of ``FINGERPRINT_BLOCK_BYTES`` at
    ``data_start + (i * (data_size - FINGERPRINT_BLOCK_BYTES)) // (FINGERPRINT_BLOCK_COUNT - 1)`` for
    ``i`` in ``0..FINGERPRINT_BLOCK_COUNT - 1`` (the first block starts the data, the last one ends the file).
    """
    header_end = 0
    if (
        header_length_bytes is not None
        and header_length_bytes <= _MAX_SAFETENSORS_HEADER_BYTES
        and _HEADER_LENGTH_BYTES + header_length_bytes <= size_bytes
    ):
        header_end = _HEADER_LENGTH_BYTES + header_length_bytes
    ranges = [(0, header_end)] if header_end else []
    data_size = size_bytes - header_end
    if data_size <= FINGERPRINT_BLOCK_COUNT * FINGERPRINT_BLOCK_BYTES:
        return [(0, size_bytes)] if size_bytes else []
    span = data_size - FINGERPRINT_BLOCK_BYTES
    for i in range(FINGERPRINT_BLOCK_COUNT):
        ranges.append((header_end + (i * span) // (FINGERPRINT_BLOCK_COUNT - 1), FINGERPRINT_BLOCK_BYTES))
    return ranges


def checkpoint_fingerprint(path: str | os.PathLike[str]) -> str:
    """The content fingerprint of a checkpoint file (``docs/format.md`` §10.2), lowercase hex.

    ``sha256(b"coldsnap-checkpoint-fingerprint-v1\\n" + u64le(size_bytes) + bytes of each range of
    fingerprint_ranges(size_bytes, N))``: the safetensors header (every tensor's name, dtype, shape and
    offsets, and the metadata) and 16 blocks of 128 KiB spread evenly over the data, or the whole file
    when it is small. It reads at most the header plus 2 MiB with ``os.pread``, so restore can check it on
    every start; it sees any change of the header or the size and any change that touches a sampled
    block, which a different fine-tune of the same base does (every tensor differs), but not an edit
    confined to bytes between the blocks (the full SHA-256 sees that).

    Raises:
        OSError: the file cannot be opened or read (``FileNotFoundError`` when it is missing).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _HEADER_LENGTH_BYTES, 0)
        header_length = int.from_bytes(head, "little") if len(head) == _HEADER_LENGTH_BYTES else None
        digest = hashlib.sha256(FINGERPRINT_DOMAIN + size.to_bytes(8, "little"))
        ranges = fingerprint_ranges(size, header_length)
        for offset, length in ranges:
            # Start every read at once: on a cold file the blocks then come in one round of
            # parallel disk reads instead of one seek after another.
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        for offset, length in ranges:
            while length:
                chunk = os.pread(fd, min(length, 8 * 1024 * 1024), offset)
                if not chunk:  # the file shrank while it was read: what was read is not this size's content
                    raise OSError(f"{os.fspath(path)} shrank while its fingerprint was read")
                digest.update(chunk)
                offset += len(chunk)
                length -= len(chunk)
        return digest.hexdigest()
    finally:
        os.close(fd)
