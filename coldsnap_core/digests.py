"""Digest validation (before any path is built) and the one rule that turns a digest into an object path
(``model-payloads/sha256/<digest>.pack``, in the cache and in every store: ``docs/format.md`` §1)."""

from __future__ import annotations

import re

from coldsnap_core.errors import InvalidDigestError

SHA256_HEX_RE = re.compile(r"[0-9a-f]{64}")
"""A SHA-256 digest as coldsnap writes it: 64 lowercase hexadecimal characters."""

PAYLOADS_DIRNAME = "model-payloads"
"""Top folder of content-addressed objects, under a state root or a store root."""


def check_digest(digest: object) -> str:
    """Return ``digest`` unchanged if it is 64 lowercase hex characters, else raise InvalidDigestError."""
    if not isinstance(digest, str) or not SHA256_HEX_RE.fullmatch(digest):
        raise InvalidDigestError(f"{digest!r} is not a SHA-256 digest (64 lowercase hexadecimal characters)")
    return digest


def pack_relpath(digest: str) -> str:
    """The object path of a pack, relative to a state root or store root (InvalidDigestError: not a digest)."""
    return f"{PAYLOADS_DIRNAME}/sha256/{check_digest(digest)}.pack"
