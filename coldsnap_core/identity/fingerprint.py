"""The content fingerprint of a checkpoint file: a few MiB sampled from it (``docs/format.md`` §10.2)."""

from __future__ import annotations

import contextlib
import hashlib
import os

from coldsnap_core.format.safetensors_header import MAX_HEADER_BYTES

FINGERPRINT_DOMAIN = b"coldsnap-checkpoint-fingerprint-v1\n"
FINGERPRINT_BLOCK_BYTES = 128 * 1024
FINGERPRINT_BLOCK_COUNT = 16
"""The fingerprint samples 16 blocks of 128 KiB (2 MiB in all) from each checkpoint file's data."""
_HEADER_LENGTH_BYTES = 8


def fingerprint_ranges(size_bytes: int, header_length_bytes: int | None) -> list[tuple[int, int]]:
    """The ``(offset_bytes, size_bytes)`` ranges of a file that :func:`checkpoint_fingerprint` hashes, in order
    (``docs/format.md`` §10.2); ``header_length_bytes``: the ``u64`` at offset 0, ``None`` for a shorter file."""
    header_end = 0
    if (
        header_length_bytes is not None
        and header_length_bytes <= MAX_HEADER_BYTES
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
    """The content fingerprint of a checkpoint file (``docs/format.md`` §10.2: what it sees and what not), lowercase hex.

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
            # every read started at once: a cold file's blocks come in one round of parallel disk reads
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
