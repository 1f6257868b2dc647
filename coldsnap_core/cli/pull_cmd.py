"""``coldsnap pull REF DIR``: write the artifact REF names (``docs/format.md`` §12.9) at DIR, every file checked
against its pin, then stage this host's packs from the same store as ``coldsnap stage`` does. Exit codes: §8."""

from __future__ import annotations

import argparse
from pathlib import Path

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cli._output import add_command_options, quiet_hub_bars, report
from coldsnap_core.cli.stage_cmd import add_host_options, stage_entries, staged_workers, this_host_entries
from coldsnap_core.stores import parse_artifact_ref
from coldsnap_core.stores.pull import pull_artifact


def run(args: argparse.Namespace) -> int:
    store, name = parse_artifact_ref(args.ref, client=args.settings.store.client)
    quiet_hub_bars()
    dest = Path(args.dir).expanduser() if args.dir.strip() else args.dir  # Path("") is ".": pull_artifact refuses ""
    pulled = pull_artifact(store, name, dest, lock_timeout_seconds=args.lock_timeout_s)
    entries = this_host_entries(args, pulled.path)
    staged = stage_entries(entries, PayloadCache(args.state_root, lock_timeout_seconds=args.lock_timeout_s), store)
    workers = staged_workers(entries, staged)
    doc = {
        "ref": args.ref,
        "store": store.name,
        "artifact": str(pulled.path),
        "artifact_sha256": pulled.sha256,
        "fetched_files": pulled.fetched_files,
        "fetched_bytes": pulled.fetched_bytes,
        "workers": workers,
        "distinct_packs": len(staged),
    }
    lines = [f"artifact {pulled.path} sha256:{pulled.sha256}", *(f"{w['capsule']}: {w['path']}" for w in workers)]
    fetched = (
        f"{pulled.fetched_files} file(s), {pulled.fetched_bytes} bytes fetched" if pulled.fetched_files else "already in place"
    )
    done = f"ok: artifact {fetched}; {len(entries)} worker(s), {len(staged)} distinct pack(s) staged ({store.name})"
    return report(args, doc, lines, done)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "pull",
        help="write a published artifact at DIR by its REF, then stage this host's packs",
        description=(
            "Resolve REF (oci://HOST/NS/REPO:TAG, s3://bucket/prefix/NAME, gs://..., az://..., hf://org/name/NAME or "
            "FOLDER/NAME: what publish-native printed) to its artifact.json, write the artifact folder at DIR with every "
            "file checked against its pin (a temporary sibling renamed into place; DIR already holding it: nothing is "
            "fetched), then stage this host's packs from that store as coldsnap stage does. Exit codes: 0 ok, 1 corrupt "
            "pack, 2 a file does not match its pin, 3 no such artifact, file or pack, 4 other error."
        ),
    )
    p.add_argument("ref", metavar="REF", help="the published artifact (what publish-native printed)")
    p.add_argument("dir", metavar="DIR", help="the artifact folder to write (its parent is created)")
    add_host_options(p, "stage")
    add_command_options(p, run)
