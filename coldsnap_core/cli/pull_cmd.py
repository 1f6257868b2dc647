"""``coldsnap pull REF DIR [--rank N | --node-rank K --workers-per-node W]``: an artifact by its name, then this host's
packs.

REF names a published artifact (what ``publish-native`` printed): ``oci://HOST/NS/REPO:TAG``,
``s3://bucket/prefix/NAME``, ``gs://bucket/prefix/NAME``, ``az://account/container/prefix/NAME``,
``hf://org/name[@revision]/NAME`` or ``FOLDER/NAME`` (``docs/format.md`` §12.9). The artifact folder is written at DIR
(``artifact.json`` checked against the name, every capsule file and ``model/`` file against its pin; a temporary
sibling renamed into place, under a lock beside DIR), then this host's packs are staged from the same store into the
node-local cache, as ``coldsnap stage`` does. DIR already holding the artifact: nothing is fetched.

Exit codes: 0 pulled and staged; 1 a pack is corrupt; 2 a pulled file does not match its pin, or a malformed
manifest; 3 the store names no such artifact or lacks a file or pack, or a rank is not in the artifact; 4 any other
error (DIR holds another artifact, the store failed, configuration).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cli._output import add_json_option, print_json
from coldsnap_core.cli._progress import quiet_hub_bars
from coldsnap_core.cli.stage_cmd import add_host_options, stage_entries, this_host_entries
from coldsnap_core.stores import parse_artifact_ref
from coldsnap_core.stores.pull import pull_artifact


def run(args: argparse.Namespace) -> int:
    store, name = parse_artifact_ref(args.ref, client=args.settings.store.client)
    quiet_hub_bars()
    dest = Path(args.dir).expanduser() if args.dir.strip() else args.dir  # Path("") is ".": pull_artifact refuses ""
    pulled = pull_artifact(store, name, dest, lock_timeout_seconds=args.lock_timeout_s)
    entries = this_host_entries(args, pulled.path)
    staged = stage_entries(entries, PayloadCache(args.state_root, lock_timeout_seconds=args.lock_timeout_s), store)
    if args.json:
        workers = [
            {"capsule": e.worker.capsule_name, "pack": e.payload.sha256, "path": str(staged[e.payload.sha256])} for e in entries
        ]
        print_json(
            {
                "ref": args.ref,
                "store": store.name,
                "artifact": str(pulled.path),
                "artifact_sha256": pulled.sha256,
                "fetched_files": pulled.fetched_files,
                "fetched_bytes": pulled.fetched_bytes,
                "workers": workers,
                "distinct_packs": len(staged),
            }
        )
        return 0
    print(f"artifact {pulled.path} sha256:{pulled.sha256}")
    for entry in entries:
        print(f"{entry.worker.capsule_name}: {staged[entry.payload.sha256]}")
    done = f"{pulled.fetched_files} file(s), {pulled.fetched_bytes} bytes fetched" if pulled.fetched_files else "already in place"
    print(f"ok: artifact {done}; {len(entries)} worker(s), {len(staged)} distinct pack(s) staged ({store.name})", file=sys.stderr)
    return 0


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
    p.add_argument(
        "--state-root", default=None, help="the cache's state root (default: $COLDSNAP_STATE_ROOT or ~/.cache/coldsnap)"
    )
    add_json_option(p)
    p.set_defaults(func=run)
