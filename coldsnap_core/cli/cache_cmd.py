"""``coldsnap cache ls|verify|gc``: look after the node-local payload cache.

``ls`` shows, for each object with a trusted validation record, when it was last hashed in full
(``verified_at``; the record fast path never refreshes it); ``verify --full`` is the scrub that hashes
every object again, refreshes that time and quarantines a corrupt object.

Exit codes (``docs/format.md``, "Exit codes"): ``ls`` and ``gc`` exit 0, or 4 when a cache folder is a
symbolic link; ``verify`` exits 0 when every object verified, 1 when any object was corrupt (each is
quarantined; the others are still checked), 3 when a named digest is not in the cache, 4 for an
invalid digest (checked before any file is touched), a symbolic link, or another error.

``gc`` removes and ``verify`` rewrites validation records, so neither touches what belongs to another
user (root's cron or ``sudo`` run over a user's state root): a state root owned by another uid is
refused before anything is read (exit 4); within one, another user's overlay (``gc``) or object or
record (``verify``) is kept as it is, named, and the command exits 4.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys

from coldsnap_core._io import lstat_or_none, refuse_symlink
from coldsnap_core.artifact.sleep_capsules import list_sleep_capsules, sweep_sleep_capsules
from coldsnap_core.cache.garbage import DEFAULT_GC_AGE_SECONDS
from coldsnap_core.cache.overlays import OverlayListing, gc_overlays, list_overlays
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cache.records import last_full_verification, record_state
from coldsnap_core.cli._output import add_json_option, error_json, print_json
from coldsnap_core.cli._progress import byte_bar
from coldsnap_core.digests import check_digest
from coldsnap_core.errors import EXIT_INTEGRITY, EXIT_OTHER, CacheError, ColdsnapError, IntegrityError


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def _last_full_verification(cache: PayloadCache, digest: str) -> tuple[str | None, int | None]:
    """``(verified_at, age in whole seconds)`` of the object's last full verification
    (:func:`~coldsnap_core.cache.records.last_full_verification`); ``(None, None)`` without a trusted record."""
    when = last_full_verification(cache, digest)
    if when is None:
        return None, None
    return when.isoformat(), int((datetime.datetime.now(datetime.UTC) - when).total_seconds())


def _age(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit}"
    return f"{max(seconds, 0)} s"


def _ls(args: argparse.Namespace) -> int:
    cache = PayloadCache(args.state_root, lock_timeout_seconds=args.lock_timeout_s)
    objects = []
    for digest in cache.digests():
        try:
            st = refuse_symlink(cache.object_path(digest))
            size = st.st_size if st else None
            state = record_state(cache, digest)
            verified_at, age_s = _last_full_verification(cache, digest)
        except ColdsnapError as exc:
            size, state, verified_at, age_s = None, f"unsafe: {exc.detail}", None, None
        objects.append(
            {"digest": digest, "size_bytes": size, "record": state, "verified_at": verified_at, "verified_age_s": age_s}
        )
    overlays = [_overlay_json(o) for o in list_overlays(cache.state_root)]
    doc = {
        "overlays": overlays,
        "state_root": str(cache.state_root),
        "objects": objects,
        "temporaries": [str(p) for p in cache.temporaries()],
        "quarantined": [str(p) for p in cache.quarantined()],
        "foreign": cache.foreign_names(),
        "debris": [
            *({"path": str(p), "kind": "temporary", "owner": "gone"} for p in cache.abandoned_temporaries()),
            *(
                {"path": str(e.path), "kind": "sleep-capsule", "owner": "gone"}
                for e in list_sleep_capsules(cache.state_root)
                if e.owner == "gone"
            ),
        ],
        "sleep_capsules": [
            {"path": str(e.path), "owner": e.owner, "size_bytes": e.size_bytes} for e in list_sleep_capsules(cache.state_root)
        ],
    }
    if args.json:
        print_json(doc)
        return 0
    print(f"state root: {cache.state_root}")
    for o in objects:
        size = "?" if o["size_bytes"] is None else str(o["size_bytes"])
        verified = (
            "" if o["verified_at"] is None else f", last fully verified {o['verified_at']} ({_age(o['verified_age_s'])} ago)"
        )
        print(f"{o['digest']}  {size:>14} bytes  {o['record']}{verified}")
    for o in overlays:
        print(f"overlay {o['path']}  {o['kind'] or '?'}  {o['status']}: {o['reason']}")
    for d in doc["debris"]:
        if d["kind"] == "temporary":
            print(f"debris {d['path']}  temporary file whose writer is gone; the next writer or coldsnap cache gc removes it")
    for c in doc["sleep_capsules"]:
        note = "process alive" if c["owner"] == "alive" else "process gone; coldsnap cache gc removes it"
        print(f"sleep capsule {c['path']}  {c['size_bytes']:>14} bytes  {note}")
    print(
        f"{len(objects)} object(s), {len(doc['temporaries'])} temporary file(s), "
        f"{len(doc['quarantined'])} quarantined, {len(doc['foreign'])} foreign name(s), "
        f"{len(doc['sleep_capsules'])} sleep capsule(s), {len(overlays)} overlay(s)"
    )
    return 0


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


def _refuse_another_users_state_root(cache: PayloadCache, command: str) -> None:
    """Refuse ``cache gc`` / ``cache verify`` over a state root another uid owns: they would remove or re-own
    (as this user's records, which that user then distrusts) what is that user's.

    Raises:
        CacheError: the state root (its link followed) belongs to another uid (exit 4).
    """
    with contextlib.suppress(FileNotFoundError):  # no state root: nothing to remove or rewrite
        if (uid := os.stat(cache.state_root).st_uid) != os.geteuid():
            raise CacheError(
                f"the state root belongs to uid {uid}, not {os.geteuid()}: coldsnap cache {command} changes only a"
                " state root of its own user; run it as that user",
                file=cache.state_root,
            )


def _another_users(cache: PayloadCache, digest: str) -> CacheError | None:
    """Why ``verify`` leaves ``digest`` alone: its object or record belongs to another uid, else ``None``."""
    for path in (cache.object_path(digest), cache.record_path(digest)):
        st = lstat_or_none(path)
        if st is not None and st.st_uid != os.geteuid():
            return CacheError(
                f"it belongs to uid {st.st_uid}, not {os.geteuid()}: left unverified, so that its validation record stays"
                " that user's",
                file=path,
            )
    return None


def _verify(args: argparse.Namespace) -> int:
    cache = PayloadCache(args.state_root, lock_timeout_seconds=args.lock_timeout_s)
    digests = [check_digest(d) for d in args.digest] if args.digest else cache.digests()
    _refuse_another_users_state_root(cache, "verify")
    failures: list[ColdsnapError] = []
    objects: list[dict[str, object]] = []
    for digest in digests:
        try:
            if (foreign := _another_users(cache, digest)) is not None:
                raise foreign
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
    if args.json:
        print_json({"state_root": str(cache.state_root), "objects": objects, "exit_code": code})
    elif not failures:
        print(f"ok: {len(digests)} object(s) verified", file=sys.stderr)
    return code


def _gc(args: argparse.Namespace) -> int:
    cache = PayloadCache(args.state_root, lock_timeout_seconds=args.lock_timeout_s)
    _refuse_another_users_state_root(cache, "gc")
    report = cache.gc(older_than_seconds=args.older_than, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    sleep_capsules = sweep_sleep_capsules(cache.state_root, dry_run=args.dry_run)
    overlays, kept = gc_overlays(cache.state_root, dry_run=args.dry_run)
    freed = report.bytes_freed + sum(e.size_bytes for e in sleep_capsules) + sum(o.size_bytes for o in overlays)
    code = EXIT_OTHER if kept else 0
    if args.json:
        removed = {
            "sleep_capsules": [str(e.path) for e in sleep_capsules],
            "temporaries": [str(p) for p in report.temporaries],
            "quarantined": [str(p) for p in report.quarantined],
            "orphan_records": [str(p) for p in report.orphan_records],
            "overlays": [_overlay_json(o) for o in overlays],
        }
        print_json(
            {
                "state_root": str(cache.state_root),
                "dry_run": args.dry_run,
                "removed": removed,
                "bytes_freed": freed,
                "kept_live": [str(p) for p in report.kept_live],
                "kept_overlays": [_overlay_json(o) for o in kept],
                "exit_code": code,
            }
        )
        return code
    for entry in sleep_capsules:
        print(f"{verb} sleep capsule {entry.path} (its process is gone)")
    for kind, paths in (
        ("temporary", report.temporaries),
        ("quarantined", report.quarantined),
        ("orphan record", report.orphan_records),
    ):
        for path in paths:
            print(f"{verb} {kind} {path}")
    for path in report.kept_live:
        print(f"kept {path} (writer alive or younger than {args.older_than:g} s)")
    for o in overlays:
        print(f"{verb} overlay {o.path} ({o.status}: {o.reason})")
    print(
        f"{verb} {len(report.temporaries)} temporary, {len(report.quarantined)} quarantined, "
        f"{len(report.orphan_records)} orphan record(s), {len(sleep_capsules)} sleep capsule(s), {len(overlays)} stale or"
        f" invalid overlay(s); {freed} bytes",
        file=sys.stderr,
    )
    for o in kept:
        print(f"kept overlay {o.path} ({o.status}: {o.reason})", file=sys.stderr)
    if kept:
        print(f"kept {len(kept)} overlay(s) that are another user's or whose artifact.json cannot be read", file=sys.stderr)
    return code


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "cache",
        help="list, verify and clean the node-local payload cache",
        description="Look after <state-root>/model-payloads: list objects and their validation records, verify them, "
        "remove stale temporary files, quarantined objects, orphan records and the sleep capsules of processes that are gone.",
    )
    sub = p.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    state_root = argparse.ArgumentParser(add_help=False)
    state_root.add_argument(
        "--state-root", default=None, help="the cache's state root (default: $COLDSNAP_STATE_ROOT or ~/.cache/coldsnap)"
    )
    add_json_option(state_root)

    ls = sub.add_parser(
        "ls", parents=[state_root], help="list objects, record states, last full verification, temporaries, quarantine"
    )
    ls.set_defaults(func=_ls)

    verify = sub.add_parser(
        "verify",
        parents=[state_root],
        help="verify objects (record fast path, else full SHA-256); quarantine corrupt ones",
        description="Exit codes: 0 verified, 1 an object was corrupt (quarantined), 3 a named digest is missing, "
        "4 invalid digest, symbolic link or other error.",
    )
    verify.add_argument("digest", nargs="*", metavar="DIGEST", help="digests to verify (default: every object)")
    verify.add_argument(
        "--full",
        action="store_true",
        help="hash in full even where a trusted record exists (the scrub: refreshes each object's last full verification)",
    )
    verify.set_defaults(func=_verify)

    gc = sub.add_parser(
        "gc",
        parents=[state_root],
        help="remove stale temporaries, quarantined objects, orphan records, and overlays whose portable artifact.json"
        " is gone or changed",
    )
    gc.add_argument(
        "--older-than",
        type=_seconds,
        default=DEFAULT_GC_AGE_SECONDS,
        metavar="SECONDS",
        help=f"only remove temporaries and quarantined objects older than this (default {DEFAULT_GC_AGE_SECONDS:g})",
    )
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed")
    gc.set_defaults(func=_gc)
