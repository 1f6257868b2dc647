"""``coldsnap cache ls|verify|rm|gc``: look after the node-local payload cache (each action: its ``--help``).

``gc``, ``rm`` and ``verify`` touch nothing of another user's: a state root another uid owns is refused, and within one
another user's overlay, object or record is kept and named. Exit codes: ``docs/format.md`` §8."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import sys
import time
from pathlib import Path

from coldsnap_core._io import lstat_or_none, refuse_symlink
from coldsnap_core.artifact.capsules import read_descriptor
from coldsnap_core.artifact.sleep_capsules import list_sleep_capsules, sweep_sleep_capsules
from coldsnap_core.cache.garbage import DEFAULT_GC_AGE_SECONDS
from coldsnap_core.cache.overlays import OverlayListing, gc_overlays, list_overlays
from coldsnap_core.cache.pack_use import Eviction, PackUsage, evict, list_packs, remove_pack
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cache.records import last_full_verification, record_state
from coldsnap_core.cli._output import add_command_options, add_outcome_log_option, byte_bar, error_json, report, seconds
from coldsnap_core.digests import check_digest
from coldsnap_core.errors import (
    EXIT_INTEGRITY,
    EXIT_OTHER,
    CacheError,
    ColdsnapError,
    IntegrityError,
    InvalidDigestError,
    MissingObjectError,
)
from coldsnap_core.outcomes import read_outcomes

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(s|m|h|d|w)?")
_DURATION_SECONDS = {None: 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([KMGT]i?)?B?")
_SIZE_POWERS = {"K": 1, "M": 2, "G": 3, "T": 4}


def _duration(text: str) -> float:
    """``--unused-for``: a number of seconds, or with a unit ``s``, ``m``, ``h``, ``d``, ``w`` (``7d``, ``12h``)."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (a number with s, m, h, d or w: 7d, 12h, 90m)")
    return float(match.group(1)) * _DURATION_SECONDS[match.group(2)]


def _size(text: str) -> int:
    """``--max-bytes``: bytes, with ``K``-``T`` (powers of 1000) or ``Ki``-``Ti`` (of 1024) as Kubernetes writes them."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or a number with K, M, G, T, Ki, Mi, Gi, Ti)")
    unit = match.group(2) or ""
    base = 1024 if unit.endswith("i") else 1000
    return int(float(match.group(1)) * base ** _SIZE_POWERS.get(unit[:1], 0))


def _artifacts_by_pack(args: argparse.Namespace, cache: PayloadCache) -> dict[str, list[str]]:
    """Digest -> the artifact folders on this node whose ``artifact.json`` names that pack: those of the load outcome
    log (``docs/format.md`` §10.3), the overlays (§15.3) and ``--artifact``, as far as they can be read."""
    folders = set(args.artifact or ())
    try:
        lines, _ = read_outcomes(args.settings.outcome_log_path, sys.maxsize)
    except OSError:
        lines = []
    folders.update(str(line["artifact_dir"]) for line in lines if isinstance(line.get("artifact_dir"), str))
    folders.update(o.descriptor.artifact_dir for o in list_overlays(cache.state_root) if o.descriptor is not None)
    users: dict[str, list[str]] = {}
    for folder in sorted(folders):
        try:
            payloads = read_descriptor(Path(folder)).distinct_payloads()
        except (ColdsnapError, OSError):
            continue
        for pack in payloads:
            users.setdefault(pack.sha256, []).append(folder)
    return users


def _iso(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC).isoformat(timespec="seconds")


def _pack_json(pack: PackUsage) -> dict[str, object]:
    return {"digest": pack.digest, "size_bytes": pack.size_bytes, "last_used_at": _iso(pack.last_used_ns)}


def _age(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit}"
    return f"{max(seconds, 0)} s"


def _objects(args: argparse.Namespace, cache: PayloadCache) -> list[dict[str, object]]:
    """``cache ls``'s objects in ``--sort`` order."""
    usage = {p.digest: p for p in list_packs(cache)}
    artifacts = _artifacts_by_pack(args, cache)
    now_ns = time.time_ns()
    now = datetime.datetime.now(datetime.UTC)
    objects = []
    for digest in cache.digests():
        pack = usage.get(digest)
        try:
            refuse_symlink(cache.object_path(digest))
            state = record_state(cache, digest)
            verified = last_full_verification(cache, digest)
        except ColdsnapError as exc:
            state, verified = f"unsafe: {exc.detail}", None
        objects.append(
            {
                "digest": digest,
                "size_bytes": None if pack is None else pack.size_bytes,
                "record": state,
                "verified_at": None if verified is None else verified.isoformat(),
                "verified_age_s": None if verified is None else int((now - verified).total_seconds()),
                "last_used_at": None if pack is None else _iso(pack.last_used_ns),
                "last_used_age_s": None if pack is None else max(now_ns - pack.last_used_ns, 0) // 10**9,
                "in_use": None if pack is None else pack.in_use,
                "artifacts": artifacts.get(digest, []),
            }
        )
    keys = {
        "name": lambda o: (o["digest"],),
        "size": lambda o: (-(o["size_bytes"] or 0), o["digest"]),
        "used": lambda o: (usage[o["digest"]].last_used_ns if o["digest"] in usage else -1, o["digest"]),
    }
    return sorted(objects, key=keys[args.sort])


def _ls(args: argparse.Namespace) -> int:
    cache = _existing_cache(args)
    objects = _objects(args, cache)
    overlays = [_overlay_json(o) for o in list_overlays(cache.state_root)]
    capsules = list_sleep_capsules(cache.state_root)
    doc = {
        "overlays": overlays,
        "state_root": str(cache.state_root),
        "objects": objects,
        "temporaries": [str(p) for p in cache.temporaries()],
        "quarantined": [str(p) for p in cache.quarantined()],
        "foreign": cache.foreign_names(),
        "debris": [
            *({"path": str(p), "kind": "temporary", "owner": "gone"} for p in cache.abandoned_temporaries()),
            *({"path": str(e.path), "kind": "sleep-capsule", "owner": "gone"} for e in capsules if e.owner == "gone"),
        ],
        "sleep_capsules": [{"path": str(e.path), "owner": e.owner, "size_bytes": e.size_bytes} for e in capsules],
    }
    lines = [f"state root: {cache.state_root}", *map(_object_line, objects)]
    lines += [f"overlay {o['path']}  {o['kind'] or '?'}  {o['status']}: {o['reason']}" for o in overlays]
    for d in doc["debris"]:
        if d["kind"] == "temporary":
            lines.append(
                f"debris {d['path']}  temporary file whose writer is gone; the next writer or coldsnap cache gc removes it"
            )
    for c in doc["sleep_capsules"]:
        note = "process alive" if c["owner"] == "alive" else "process gone; coldsnap cache gc removes it"
        lines.append(f"sleep capsule {c['path']}  {c['size_bytes']:>14} bytes  {note}")
    lines.append(
        f"{len(objects)} object(s), {len(doc['temporaries'])} temporary file(s), "
        f"{len(doc['quarantined'])} quarantined, {len(doc['foreign'])} foreign name(s), "
        f"{len(doc['sleep_capsules'])} sleep capsule(s), {len(overlays)} overlay(s)"
    )
    return report(args, doc, lines)


def _object_line(o: dict[str, object]) -> str:
    size = "?" if o["size_bytes"] is None else str(o["size_bytes"])
    used = "last used ?" if o["last_used_at"] is None else f"last used {o['last_used_at']} ({_age(o['last_used_age_s'])} ago)"
    held = ", in use by a running load" if o["in_use"] else ""
    verified = "" if o["verified_at"] is None else f", last fully verified {o['verified_at']} ({_age(o['verified_age_s'])} ago)"
    users = ", ".join(o["artifacts"]) or "none known"
    return f"{o['digest']}  {size:>14} bytes  {used}{held}  {o['record']}{verified}  artifacts: {users}"


def _overlay_json(o: OverlayListing) -> dict[str, object]:
    d = o.descriptor
    return {
        "path": str(o.path),
        "status": o.status,
        "reason": o.reason,
        "kind": d.kind if d else None,
        "artifact_dir": d.artifact_dir if d else None,
        "portable_descriptor_sha256": d.portable_descriptor_sha256 if d else None,
        "worker": d.worker.capsule_name if d else None,
        "engine": f"{d.target.engine} {d.target.engine_version}" if d else None,
        "size_bytes": o.size_bytes,
    }


def _existing_cache(args: argparse.Namespace, command: str | None = None) -> PayloadCache:
    """The cache of ``args.state_root``, which must exist (a mistyped one is not an empty cache: ``MissingObjectError``);
    for ``cache COMMAND``, which removes or re-owns what is there, one of this user's (else ``CacheError``)."""
    cache = PayloadCache(args.state_root, lock_timeout_seconds=args.lock_timeout_s)
    if not os.path.lexists(cache.state_root):
        raise MissingObjectError(
            f"the state root {cache.state_root} does not exist: nothing was ever cached there",
            file=cache.state_root,
            remedy="check --state-root or COLDSNAP_STATE_ROOT (the engines' state root; default ~/.cache/coldsnap)",
        )
    with contextlib.suppress(FileNotFoundError):  # a dangling link: nothing to remove or rewrite
        if command is not None and (uid := os.stat(cache.state_root).st_uid) != os.geteuid():
            raise CacheError(
                f"the state root belongs to uid {uid}, not {os.geteuid()}: coldsnap cache {command} changes only a"
                " state root of its own user; run it as that user",
                file=cache.state_root,
            )
    return cache


def _verify(args: argparse.Namespace) -> int:
    given = [check_digest(d) for d in args.digest] if args.digest else None
    cache = _existing_cache(args, "verify")
    digests = given if given is not None else cache.digests()
    failures: list[ColdsnapError] = []
    objects: list[dict[str, object]] = []
    for digest in digests:
        try:
            for path in (cache.object_path(digest), cache.record_path(digest)):  # another uid's: left unverified
                st = lstat_or_none(path)
                if st is not None and st.st_uid != os.geteuid():
                    raise CacheError(
                        f"it belongs to uid {st.st_uid}, not {os.geteuid()}: left unverified, so that its validation record"
                        " stays that user's",
                        file=path,
                    )
            before = record_state(cache, digest) if not args.full else "ignored"
            st = refuse_symlink(cache.object_path(digest))
            with byte_bar(f"verify {digest[:12]}", st.st_size if st else None) as update:
                if args.full:
                    cache.reverify(digest, progress=update)
                else:
                    cache.admit(digest, progress=update)
            how = "trusted validation record" if before == "trusted" else "full SHA-256"
            objects.append({"digest": digest, "verified": True, "how": how})
            if not args.json:
                print(f"ok {digest} ({how})")
        except ColdsnapError as exc:
            objects.append({"digest": digest, "verified": False, "error": error_json(exc)})
            if not args.json:
                print(f"coldsnap cache verify: {digest}: {exc}", file=sys.stderr)
            failures.append(exc)
    code = 0
    if failures:
        code = EXIT_INTEGRITY if any(isinstance(exc, IntegrityError) for exc in failures) else failures[0].exit_code
    done = None if failures else f"ok: {len(digests)} object(s) verified"
    return report(args, {"state_root": str(cache.state_root), "objects": objects, "exit_code": code}, done=done, code=code)


SHORT_DIGEST_MIN_CHARS = 12
"""The fewest leading hex characters of a digest ``cache rm`` takes for it (the logs print 12)."""


def _digest_named(cache: PayloadCache, given: str) -> str:
    """The digest ``given`` names: itself, or the one cached digest it starts (:data:`SHORT_DIGEST_MIN_CHARS` or more).

    Raises:
        InvalidDigestError: ``given`` is neither (no file touched), or it starts more than one cached digest (named).
        MissingObjectError: it starts no cached digest.
    """
    if len(given) >= 64 or not re.fullmatch(f"[0-9a-f]{{{SHORT_DIGEST_MIN_CHARS},}}", given):
        return check_digest(given)
    matches = [d for d in cache.digests() if d.startswith(given)]
    if len(matches) > 1:
        raise InvalidDigestError(
            f"{given} starts {len(matches)} cached packs' digests: {', '.join(matches)}",
            remedy="give more of the digest, enough to name one pack",
        )
    if not matches:
        raise MissingObjectError(
            f"no pack in the node-local cache has a digest starting {given} (coldsnap cache ls lists the packs)",
            file=cache.objects_dir,
        )
    return matches[0]


def _rm(args: argparse.Namespace) -> int:
    cache = _existing_cache(args, "rm")
    pack = remove_pack(cache, _digest_named(cache, args.digest), force=args.force)
    removed = {**_pack_json(pack), "was_in_use": pack.in_use}
    forced = "; a running load held it (--force)" if pack.in_use else ""
    line = f"removed pack {pack.digest} ({pack.size_bytes} bytes, last used {_iso(pack.last_used_ns)}){forced}"
    return report(args, {"state_root": str(cache.state_root), "removed": removed, "bytes_freed": pack.size_bytes}, [line])


def _gc(args: argparse.Namespace) -> int:
    cache = _existing_cache(args, "gc")
    swept = cache.gc(older_than_seconds=args.older_than, dry_run=args.dry_run)
    if args.unused_for is None and args.max_bytes is None:
        eviction = Eviction((), (), 0, sum(p.size_bytes for p in list_packs(cache)))
    else:
        eviction = evict(cache, unused_for_seconds=args.unused_for, max_bytes=args.max_bytes, dry_run=args.dry_run)
    over = args.max_bytes is not None and eviction.remaining_bytes > args.max_bytes
    verb = "would remove" if args.dry_run else "removed"
    sleep_capsules = sweep_sleep_capsules(cache.state_root, dry_run=args.dry_run)
    overlays, kept = gc_overlays(cache.state_root, dry_run=args.dry_run)
    freed = swept.bytes_freed + sum(e.size_bytes for e in sleep_capsules) + sum(o.size_bytes for o in overlays)
    freed += eviction.bytes_freed
    code = EXIT_OTHER if kept or over else 0
    removed = {
        "packs": [_pack_json(p) for p in eviction.removed],
        "sleep_capsules": [str(e.path) for e in sleep_capsules],
        "temporaries": [str(p) for p in swept.temporaries],
        "quarantined": [str(p) for p in swept.quarantined],
        "orphan_records": [str(p) for p in swept.orphan_records],
        "overlays": [_overlay_json(o) for o in overlays],
    }
    doc = {
        "state_root": str(cache.state_root),
        "dry_run": args.dry_run,
        "removed": removed,
        "bytes_freed": freed,
        "kept_live": [str(p) for p in swept.kept_live],
        "kept_in_use": list(eviction.kept_in_use),
        "kept_overlays": [_overlay_json(o) for o in kept],
        "pack_bytes": eviction.remaining_bytes,
        "exit_code": code,
    }
    lines = [f"{verb} pack {p.digest} ({p.size_bytes} bytes, last used {_iso(p.last_used_ns)})" for p in eviction.removed]
    lines += [f"kept pack {digest} (in use by a running load)" for digest in eviction.kept_in_use]
    lines += [f"{verb} sleep capsule {e.path} (its process is gone)" for e in sleep_capsules]
    for kind, paths in (
        ("temporary", swept.temporaries),
        ("quarantined", swept.quarantined),
        ("orphan record", swept.orphan_records),
    ):
        lines += [f"{verb} {kind} {path}" for path in paths]
    lines += [f"kept {path} (writer alive or younger than {args.older_than:g} s)" for path in swept.kept_live]
    lines += [f"{verb} overlay {o.path} ({o.status}: {o.reason})" for o in overlays]
    notes = []  # on stderr
    if over:
        notes.append(
            f"the packs left total {eviction.remaining_bytes} bytes, over --max-bytes {args.max_bytes}: the rest are in use"
        )
    notes.append(
        f"{verb} {len(eviction.removed)} pack(s), {len(swept.temporaries)} temporary, {len(swept.quarantined)} quarantined, "
        f"{len(swept.orphan_records)} orphan record(s), {len(sleep_capsules)} sleep capsule(s), {len(overlays)} stale or"
        f" invalid overlay(s); {freed} bytes"
    )
    notes += [f"kept overlay {o.path} ({o.status}: {o.reason})" for o in kept]
    if kept:
        notes.append(f"kept {len(kept)} overlay(s) that are another user's or whose artifact.json cannot be read")
    return report(args, doc, lines, "\n".join(notes), code)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "cache",
        help="list, verify and clean the node-local payload cache",
        description="Look after <state-root>/model-payloads, the node-local payload cache: each ACTION below (gc also removes"
        " the sleep capsules of processes that are gone).",
    )
    sub = p.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    ls = sub.add_parser(
        "ls",
        help="list packs (size, last use, in use, the artifacts on this node that use them, record state, last full"
        " verification), temporaries, quarantine",
    )
    add_command_options(ls, _ls)
    ls.add_argument(
        "--sort",
        choices=("name", "size", "used"),
        default="name",
        help="order of the packs: name (digest, default), size (largest first), used (least recently used first: gc's"
        " eviction order)",
    )
    ls.add_argument(
        "--artifact",
        action="append",
        metavar="DIR",
        help="also name the packs this artifact folder uses (repeatable; the load outcome log and the overlays name the others)",
    )
    add_outcome_log_option(ls, "the load outcome log whose artifacts are listed")

    rm = sub.add_parser(
        "rm",
        help="remove one pack (its record and use file too); refuses a pack a running load holds",
        description="Exit codes: 0 removed, 3 the digest is not in the cache, 4 invalid digest (or a short one that"
        " starts several cached digests, named), the pack is in use"
        " (rule pack-in-use; --force removes it anyway), symlink or other error.",
    )
    add_command_options(rm, _rm)
    rm.add_argument(
        "digest",
        metavar="DIGEST",
        help="the pack's SHA-256, or its first 12 or more hex characters (as the logs print it) when no other pack's starts so",
    )
    rm.add_argument(
        "--force",
        action="store_true",
        help="remove it even while a running load holds it (that load keeps its open copy; the next load fetches it again)",
    )

    verify = sub.add_parser(
        "verify",
        help="verify objects (record fast path, else full SHA-256); quarantine corrupt ones",
        description="Exit codes: 0 verified, 1 an object was corrupt (quarantined), 3 a named digest is missing, "
        "4 invalid digest, symbolic link or other error.",
    )
    add_command_options(verify, _verify)
    verify.add_argument("digest", nargs="*", metavar="DIGEST", help="digests to verify (default: every object)")
    verify.add_argument(
        "--full",
        action="store_true",
        help="hash in full even where a trusted record exists (the scrub: refreshes each object's last full verification)",
    )
    _add_gc(sub)


def _add_gc(sub: argparse._SubParsersAction) -> None:
    gc = sub.add_parser(
        "gc",
        help="remove stale temporaries, quarantined objects, orphan records, and overlays whose portable artifact.json"
        " is gone or changed; with --unused-for or --max-bytes, packs least recently used first",
    )
    add_command_options(gc, _gc)
    gc.add_argument(
        "--older-than",
        type=seconds,
        default=DEFAULT_GC_AGE_SECONDS,
        metavar="SECONDS",
        help=f"only remove temporaries and quarantined objects older than this (default {DEFAULT_GC_AGE_SECONDS:g})",
    )
    gc.add_argument(
        "--unused-for",
        type=_duration,
        metavar="DURATION",
        help="also remove every pack last used longer ago than this (7d, 12h, 90m, 30s; a number is seconds), never one"
        " a running load holds",
    )
    gc.add_argument(
        "--max-bytes",
        type=_size,
        metavar="SIZE",
        help="then remove packs, least recently used first, until they total at most SIZE (50G, 500Mi; K M G T are"
        " powers of 1000, Ki Mi Gi Ti of 1024), never one a running load holds (exit 4 when those keep it over)",
    )
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed")
