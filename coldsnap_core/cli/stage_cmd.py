"""``coldsnap stage ARTIFACT [--rank N ...]``: put this host's packs into the node-local cache, verified.

Exit codes: 0 every requested pack is staged and verified; 1 a pack is corrupt (a cached one with no
store to repair it from, now quarantined, or the store's copy, named by its place in the store;
nothing is kept); 2 a malformed manifest or descriptor; 3 a pack is unavailable (not cached and not
in the store) or a rank is not in the artifact; 4 any other error (the store did not answer or
failed, configuration, symbolic link, artifact inconsistency).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from coldsnap_core.artifact import read_descriptor
from coldsnap_core.cache import PayloadCache
from coldsnap_core.cli._progress import byte_bar
from coldsnap_core.cli._targets import artifact_folder
from coldsnap_core.errors import MissingObjectError
from coldsnap_core.staging import stage_payload, worker_entries
from coldsnap_core.stores import from_env, parse_store_spec


def run(args: argparse.Namespace) -> int:
    artifact_dir = artifact_folder(args.artifact)
    cache = PayloadCache(args.state_root)
    store = parse_store_spec(args.repo) if args.repo else from_env()
    descriptor = read_descriptor(artifact_dir)
    workers = [entry.worker for entry in descriptor.workers]
    if args.rank:
        missing = sorted(set(args.rank) - {w.rank for w in workers})
        if missing:
            raise MissingObjectError(
                f"the artifact lists no worker with rank {', '.join(map(str, missing))}", file=artifact_dir / "artifact.json"
            )
        workers = [w for w in workers if w.rank in set(args.rank)]
    entries = worker_entries(artifact_dir, workers)
    staged: dict[str, Path] = {}
    for entry in entries:
        pack = entry.payload
        if pack.sha256 not in staged:
            with byte_bar(f"stage {pack.sha256[:12]}", None) as update:
                staged[pack.sha256] = stage_payload(pack, cache=cache, store=store, progress=update)
        print(f"{entry.worker.capsule_name}: {staged[pack.sha256]}")
    source = store.name if store is not None else "the node-local cache only"
    print(f"ok: {len(entries)} worker(s), {len(staged)} distinct pack(s) staged (store: {source})", file=sys.stderr)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "stage",
        help="stage (and verify) the packs of this host's workers into the node-local cache",
        description=(
            "For each selected worker of ARTIFACT, make its pack available in <state-root>/model-payloads: from the cache "
            "(validation record or full SHA-256), else from the payload store (--repo, COLDSNAP_PAYLOAD_DIR or "
            "COLDSNAP_PAYLOAD_REPO). Exit codes: 0 staged, 1 corrupt pack, 2 malformed manifest, 3 pack unavailable or "
            "unknown rank, 4 other error (including a store that did not answer)."
        ),
    )
    p.add_argument("artifact", metavar="ARTIFACT", help="artifact folder (with artifact.json), or its artifact.json")
    p.add_argument(
        "--rank", type=int, action="append", metavar="N", help="stage only the worker with this rank (repeatable; default: all)"
    )
    p.add_argument("--repo", default=None, help="payload store: a folder path or a Hugging Face repo id org/name[@revision]")
    p.add_argument(
        "--state-root", default=None, help="the cache's state root (default: $COLDSNAP_STATE_ROOT or ~/.cache/coldsnap)"
    )
    p.set_defaults(func=run)
