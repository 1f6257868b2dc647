"""The load outcome log: one JSON line per worker load, so a fleet sees its fallbacks (``docs/format.md`` §10.3).
Appending never fails a load (a log that cannot be written is one WARNING per process); each line is one ``write``
on an ``O_APPEND`` descriptor, and a log over :data:`OUTCOME_LOG_ROTATE_BYTES` is renamed to ``<path>.1`` first."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import json
import logging
import os
import socket
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import filelock

from coldsnap_core.errors import ColdsnapError

logger = logging.getLogger(__name__)

OUTCOME_KIND = "coldsnap.load-outcome"
OUTCOME_VERSION = 1
OUTCOME_LOG_ROTATE_BYTES = 16 * 2**20
"""A log larger than this (bytes) is renamed to ``<path>.1`` before the next line is appended."""
OUTCOME_LOG_READ_BYTES = 2 * OUTCOME_LOG_ROTATE_BYTES
"""The most ``read_outcomes`` reads, from the end of the log."""
MAX_DETAIL_CHARS = 2000
"""An error's detail is cut to this many characters (``…`` appended), so a line stays small."""

Outcome = Literal["restored", "captured", "fell-back", "refused", "checkpoint"]
OUTCOMES: tuple[str, ...] = ("restored", "captured", "fell-back", "refused", "checkpoint")

DERIVED_CACHE_VALUES: tuple[str, ...] = ("used", "skipped", "absent")
"""The values of a line's ``derived_cache`` (``docs/format.md`` §17.4), besides ``null``."""

_warned: set[str] = set()


@dataclass(frozen=True, slots=True)
class LoadOutcomeLine:
    """One outcome log line, ``docs/format.md`` §10.3 (``error``: of ``fell-back`` and ``refused``, written as its class
    name, ``rule``, ``file`` and ``detail``; ``checkpoint_absent``: the key ``"checkpoint": "absent"``, only then)."""

    outcome: Outcome
    engine: str
    worker: str
    artifact_dir: str | None
    seconds: float
    materialization_started: bool = False
    error: ColdsnapError | None = None
    pack_sha256: str | None = None
    derived_cache: str | None = None
    derived_cache_reason: str | None = None
    checkpoint_absent: bool = False

    def to_json(self, *, now: datetime.datetime | None = None) -> dict[str, object]:
        now = now or datetime.datetime.now(datetime.UTC)
        detail = None if self.error is None else _capped(self.error.detail)
        absent = {"checkpoint": "absent"} if self.checkpoint_absent else {}
        return {
            **absent,
            "format": OUTCOME_KIND,
            "format_version": OUTCOME_VERSION,
            "time": now.isoformat(timespec="milliseconds"),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "engine": self.engine,
            "worker": self.worker,
            "artifact_dir": self.artifact_dir,
            "outcome": self.outcome,
            "seconds": round(self.seconds, 3),
            "materialization_started": self.materialization_started,
            "error": None if self.error is None else type(self.error).__name__,
            "rule": None if self.error is None else self.error.rule,
            "file": None if self.error is None or self.error.file is None else str(self.error.file),
            "detail": detail,
            "pack_sha256": self.pack_sha256,
            "derived_cache": self.derived_cache,
            "derived_cache_reason": None if self.derived_cache_reason is None else _capped(self.derived_cache_reason),
        }


def _rotate_if_large(path: Path) -> None:
    try:
        if os.lstat(path).st_size <= OUTCOME_LOG_ROTATE_BYTES:
            return
    except FileNotFoundError:
        return
    with filelock.FileLock(f"{path}.lock", timeout=10), contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_size > OUTCOME_LOG_ROTATE_BYTES:  # another writer may have rotated it
            os.replace(path, f"{path}.1")


def append_outcome(path: str | os.PathLike[str], line: LoadOutcomeLine) -> bool:
    """Append ``line`` to the log; whether it was written. Never raises (a link is refused): one WARNING per path and process."""
    path = Path(path)
    data = (json.dumps(line.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n").encode("ascii")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _rotate_if_large(path)
        # O_NONBLOCK: a named pipe at the path must not block the load (no reader: ENXIO; a reader: refused below)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        fd = os.open(path, flags, 0o600)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{path} is not a regular file")
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(f"short write ({written} of {len(data)} bytes)")
        finally:
            os.close(fd)
    except (OSError, ValueError, filelock.Timeout) as exc:
        if str(path) not in _warned:
            _warned.add(str(path))
            logger.warning(
                "coldsnap: cannot append to the load outcome log %s (%s); outcomes of this process go unrecorded", path, exc
            )
        return False
    return True


@dataclass(frozen=True, slots=True)
class ArtifactSummary:
    """The recent outcomes of one artifact folder (``None``: loads without an artifact): ``counts`` per outcome,
    the ``last`` line and ``last_failure`` (``fell-back`` or ``refused``), and lines per ``derived_cache`` value."""

    artifact_dir: str | None
    counts: dict[str, int]
    last: dict[str, object]
    last_failure: dict[str, object] | None
    derived_cache: dict[str, int] | None = None

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def read_outcomes(path: str | os.PathLike[str], last: int) -> tuple[list[dict[str, object]], int]:
    """The last ``last`` well-formed lines of the outcome log (oldest first) and how many were skipped as malformed,
    of at most :data:`OUTCOME_LOG_READ_BYTES` from its end; ``OSError`` when it exists but is no readable regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return [], 0
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "the outcome log is not a regular file", str(path))
        start = max(0, st.st_size - OUTCOME_LOG_READ_BYTES)
        f.seek(start)
        raw = f.read(OUTCOME_LOG_READ_BYTES).splitlines()
    if start > 0 and raw:
        raw = raw[1:]  # the first line read from the middle of the file is partial
    lines, skipped = [], 0
    for text in raw[-last:] if last > 0 else []:
        try:
            doc = json.loads(text)
        except ValueError:
            doc = None
        well_formed = isinstance(doc, dict) and doc.get("format") == OUTCOME_KIND and doc.get("format_version") == OUTCOME_VERSION
        if well_formed and doc.get("outcome") in OUTCOMES:
            lines.append(doc)
        else:
            skipped += 1
    return lines, skipped


def _capped(text: str) -> str:
    """``text`` cut to :data:`MAX_DETAIL_CHARS` (a seed's reason quotes fields an artifact author wrote)."""
    return text if len(text) <= MAX_DETAIL_CHARS else text[:MAX_DETAIL_CHARS] + "…"


def summarize(lines: Iterable[dict[str, object]]) -> list[ArtifactSummary]:
    """Group outcome lines (oldest first) by ``artifact_dir``; artifacts sorted by their most recent line, newest first."""
    groups: dict[str | None, list[dict[str, object]]] = {}
    for doc in lines:
        artifact = doc.get("artifact_dir")
        groups.setdefault(artifact if isinstance(artifact, str) else None, []).append(doc)
    summaries = []
    for artifact, docs in groups.items():
        counts = dict.fromkeys(OUTCOMES, 0)
        seeds = dict.fromkeys(DERIVED_CACHE_VALUES, 0)
        for doc in docs:
            counts[str(doc["outcome"])] += 1
            if isinstance(doc.get("derived_cache"), str) and doc["derived_cache"] in seeds:  # any other JSON value: not counted
                seeds[str(doc["derived_cache"])] += 1
        failures = [d for d in docs if d["outcome"] in ("fell-back", "refused")]
        summaries.append(ArtifactSummary(artifact, counts, docs[-1], failures[-1] if failures else None, seeds))
    summaries.sort(key=lambda s: str(s.last.get("time", "")), reverse=True)
    return summaries
