"""``coldsnap cache gc``'s sweeps of stale temporaries and quarantined objects (``docs/format.md`` §10, gc)."""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from coldsnap_core._io import lstat_or_none, remove_tree
from coldsnap_core.cache.partials import DOWNLOAD_DIR_SUFFIX, TEMP_SUFFIX, list_folder, tree_size, writer_gone

DEFAULT_GC_AGE_SECONDS = 3600.0
"""``coldsnap cache gc`` removes temporaries and quarantined objects older than this (1 hour)."""


@dataclass(frozen=True, slots=True)
class GcReport:
    """What :meth:`PayloadCache.gc` removed (``dry_run``: would remove); ``kept_live``: temporaries it left in place."""

    temporaries: tuple[Path, ...] = ()
    quarantined: tuple[Path, ...] = ()
    orphan_records: tuple[Path, ...] = ()
    kept_live: tuple[Path, ...] = ()
    bytes_freed: int = 0


@dataclass(slots=True)
class GcBuilder:
    temporaries: list[Path] = field(default_factory=list)
    quarantined: list[Path] = field(default_factory=list)
    orphan_records: list[Path] = field(default_factory=list)
    kept_live: list[Path] = field(default_factory=list)
    bytes_freed: int = 0

    def freeze(self) -> GcReport:
        return GcReport(
            tuple(self.temporaries), tuple(self.quarantined), tuple(self.orphan_records), tuple(self.kept_live), self.bytes_freed
        )


def sweep_temporaries(tmp_dir: Path, report: GcBuilder, *, now: float, older_than_seconds: float, dry_run: bool) -> None:
    """Remove (or, with ``dry_run``, list in ``report``) the stale temporaries of ``tmp_dir``."""
    entries = {p.name: p for p in list_folder(tmp_dir)}
    stale_partials: set[str] = set()
    for name, path in sorted(entries.items()):
        if not name.endswith(TEMP_SUFFIX) or (st := lstat_or_none(path)) is None:
            continue
        if now - st.st_mtime < older_than_seconds or (stat.S_ISREG(st.st_mode) and not writer_gone(path)):
            report.kept_live.append(path)
            continue
        stale_partials.add(name)
        report.temporaries.append(path)
        report.bytes_freed += st.st_size if stat.S_ISREG(st.st_mode) else 0
        if not dry_run:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    for name, path in sorted(entries.items()):
        if not name.endswith(DOWNLOAD_DIR_SUFFIX) or (st := lstat_or_none(path)) is None:
            continue
        owner = name[: -len(".d")]
        owner_alive = owner in entries and owner not in stale_partials
        if owner_alive or (owner not in entries and now - st.st_mtime < older_than_seconds):
            report.kept_live.append(path)
            continue
        report.temporaries.append(path)
        report.bytes_freed += tree_size(path)
        if not dry_run:
            remove_tree(path)


def sweep_quarantine(quarantine_dir: Path, report: GcBuilder, *, now: float, older_than_seconds: float, dry_run: bool) -> None:
    """Remove (or, with ``dry_run``, list in ``report``) each entry quarantined (by ctime) before the threshold."""
    for path in list_folder(quarantine_dir):
        st = lstat_or_none(path)
        if st is None or now - st.st_ctime < older_than_seconds:
            continue
        report.quarantined.append(path)
        report.bytes_freed += st.st_size if stat.S_ISREG(st.st_mode) else 0
        if not dry_run:
            remove_tree(path)
