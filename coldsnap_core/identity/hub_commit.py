"""The commit a Hugging Face repository id's revision resolves to in the local cache (``docs/format.md`` §10.1)."""

from __future__ import annotations

import logging
import os
import re

from coldsnap_core._io import os_error

logger = logging.getLogger(__name__)

COMMIT_HASH = re.compile(r"[0-9a-f]{40}")
"""A Hugging Face commit hash: 40 lowercase hex digits (``huggingface_hub``'s ``REGEX_COMMIT_HASH``)."""


def resolve_hub_commit(
    repo_id: str, revision: str | None, *, cache_dir: str | os.PathLike[str] | None = None, repo_type: str = "model"
) -> str | None:
    """The commit hash the local Hugging Face cache resolves ``revision or "main"`` of ``repo_id`` to, offline (a 40-hex
    ``revision`` as is), or ``None``; ``cache_dir``: vLLM's ``--download-dir`` (``None``: ``HF_HUB_CACHE``).

    Raises:
        FileAccessError: the cache exists but cannot be read (anything but "no such file"), naming the file.
    """
    if revision is not None and not hasattr(revision, "resolved") and COMMIT_HASH.fullmatch(str(revision)):
        return str(revision)  # a ResolvedRevision goes through huggingface_hub, which reads its .resolved
    import huggingface_hub
    from huggingface_hub.errors import RevisionResolutionError

    try:
        commit = (  # the cache's refs/<revision> entry
            huggingface_hub.HfApi()
            .resolve_revision(repo_id, repo_type=repo_type, revision=revision, cache_dir=cache_dir, local_files_only=True)
            .resolved
        )
    except (RevisionResolutionError, ValueError, FileNotFoundError, NotADirectoryError) as exc:
        logger.debug("coldsnap: the Hugging Face cache does not resolve %s@%s: %s", repo_id, revision or "main", exc)
        return None
    except OSError as exc:
        # only an absent cache entry means "no commit": a cache that cannot be read (EACCES, EIO) is named
        raise os_error(
            f"the Hugging Face cache entry of {repo_id}@{revision or 'main'} cannot be read", exc, exc.filename or cache_dir
        ) from exc
    return commit if commit is not None and COMMIT_HASH.fullmatch(commit) else None
