"""``coldsnap publish-native ARTIFACT... --repo REPO [--name NAME] [--dry-run]``: upload each distinct model payload
once, then each artifact's own files and its name, and print the REF that ``coldsnap pull`` takes.

REPO is a Hugging Face repository id (``org/name[@revision]``; token and endpoint from ``HF_TOKEN`` and
``HF_ENDPOINT``; a missing repository is created, private unless ``--public``), an S3-compatible bucket
(``s3://bucket/prefix``; endpoint and credentials from the AWS variables), an OCI registry repository
(``oci://HOST/NAMESPACE/NAME[:TAG]``; a manifest per artifact is pushed too), a GCS bucket (``gs://bucket/prefix``),
an Azure Blob container (``az://account/container/prefix`` or a connection string) or a folder (``/abs``, ``./rel``, ``../rel``, ``~/...`` or ``file://...``). Objects go to
``model-payloads/sha256/<digest>.pack`` there; the path comes from the digest alone. Each artifact's files
(``artifact.json``, its capsule files, its ``model/`` files) go to ``artifacts/sha256/<SHA-256 of artifact.json>/``
(on OCI: layers of the artifact's manifest), then its name (``--name``, default the folder's name) is written last:
``refs/<NAME>.json``, or the OCI tag (``docs/format.md`` §12.9). Stdout names each: ``ref REF`` for each artifact.

A payload counts as present only if the store's object verifies as far as the store can tell (a
folder store: its SHA-256 is hashed; the Hugging Face store: the LFS SHA-256 the Hub reports); a
corrupt store object is replaced. ``--dry-run`` checks the store's objects by size (and the Hub's LFS
SHA-256) only.

Exit codes: 0 every payload is in the store (uploaded now or already present; with ``--dry-run``: the
checks passed); 1 a local object does not verify (it is quarantined, nothing more is uploaded);
2 a malformed manifest or descriptor, including one whose extent digests or layout do not describe
its (intact, kept) pack; 3 an artifact or a local object to upload is missing; 4 any other error (the
store failed, bad REPO, symbolic link, artifact inconsistency).
"""

from __future__ import annotations

import argparse
import sys

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cli._output import add_json_option, print_json
from coldsnap_core.cli._progress import BarFactory, quiet_hub_bars
from coldsnap_core.cli._targets import artifact_folder
from coldsnap_core.stores import artifact_ref, parse_store_spec
from coldsnap_core.stores.base import PayloadStore
from coldsnap_core.stores.publish import PublishedFile, PublishedPayload, artifact_listing, publish_native


def _set_visibility(store: PayloadStore, public: bool) -> None:
    from coldsnap_core.stores.hf import HfPayloadStore

    if isinstance(store, HfPayloadStore):
        store.private = not public


def run(args: argparse.Namespace) -> int:
    store = parse_store_spec(args.repo, client=args.settings.store.client)
    if args.public:
        _set_visibility(store, True)
    quiet_hub_bars()
    cache = PayloadCache(args.state_root, lock_timeout_seconds=args.lock_timeout_s)
    bars = BarFactory()
    manifests: list[str] = []
    files: list[PublishedFile] = []
    folders = [artifact_folder(a) for a in args.artifact]

    def report(item: PublishedPayload) -> None:
        bars.close()
        if not args.json:
            print(f"{item.action} {item.pack.sha256} ({item.pack.size_bytes} bytes) <- {', '.join(item.owners)}")

    def report_file(item: PublishedFile) -> None:
        files.append(item)

    def report_manifest(reference: str) -> None:
        manifests.append(reference)
        if not args.json:
            print(f"{store.record_kind} {reference}")

    try:
        results = publish_native(
            folders,
            store,
            cache,
            name=args.name,
            dry_run=args.dry_run,
            progress=bars,
            on_payload=report,
            on_file=report_file,
            on_artifact=report_manifest,
        )
    finally:
        bars.close()
    refs = [] if args.dry_run else [artifact_ref(args.repo, store, artifact_listing(f, args.name).name) for f in folders]
    counts = {action: sum(r.action == action for r in results) for action in ("uploaded", "present", "would-upload")}
    if args.json:
        payloads = [
            {"action": r.action, "sha256": r.pack.sha256, "size_bytes": r.pack.size_bytes, "owners": list(r.owners)}
            for r in results
        ]
        published = [
            {
                "artifact": f.artifact,
                "path": f.file.path,
                "sha256": f.file.sha256,
                "size_bytes": f.file.size_bytes,
                "action": f.action,
            }
            for f in files
        ]
        print_json(
            {
                "store": store.name,
                "dry_run": args.dry_run,
                "payloads": payloads,
                "files": published,
                "manifests": manifests,
                "refs": refs,
                "counts": counts,
            }
        )
        return 0
    for name in dict.fromkeys(f.artifact for f in files):  # one line per artifact: its files are small and many
        mine = [f for f in files if f.artifact == name]
        done = ", ".join(f"{sum(f.action == a for f in mine)} {a}" for a in ("uploaded", "present", "would-upload"))
        print(f"files {name}: {len(mine)} ({done})")
    for ref in refs:
        print(f"ref {ref}")
    print(
        f"ok: {len(results)} distinct payload(s) -> {store.name}: {counts['uploaded']} uploaded, "
        f"{counts['present']} already present" + (f", {counts['would-upload']} would be uploaded" if args.dry_run else ""),
        file=sys.stderr,
    )
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "publish-native",
        help="upload each distinct model payload of artifacts to a payload store, once",
        description=(
            "Verify each local pack named by the artifacts' workers in full, then upload every distinct digest once to "
            "model-payloads/sha256/<digest>.pack in REPO, skipping digests already present (a corrupt store object is "
            "replaced); then each artifact's files to artifacts/sha256/<digest of artifact.json>/ and its name last "
            "(refs/NAME.json, or the OCI tag), and print the REF coldsnap pull takes. Exit codes: 0 ok, "
            "1 a local pack is corrupt, 2 malformed manifest, 3 missing artifact or local pack, 4 other error."
        ),
    )
    p.add_argument("artifact", nargs="+", metavar="ARTIFACT", help="artifact folder(s) (with artifact.json)")
    p.add_argument(
        "--repo",
        required=True,
        help=(
            "Hugging Face repo id org/name[@revision], s3://bucket/prefix, oci://host/ns/name[:tag], gs://bucket/prefix, "
            "az://account/container/prefix (or an Azure connection string), or a folder path (/abs, ./rel, ~/x, file://)"
        ),
    )
    p.add_argument(
        "--name",
        default=None,
        help="the artifact's name in the store (one ARTIFACT only; default: its folder's name): refs/NAME.json, or the OCI"
        " tag when REPO has none",
    )
    p.add_argument(
        "--public", action="store_true", help="create a missing Hugging Face repository public (default: private, as hf upload)"
    )
    p.add_argument("--dry-run", action="store_true", help="check presence and local objects; hash and upload nothing")
    p.add_argument(
        "--state-root", default=None, help="the cache's state root (default: $COLDSNAP_STATE_ROOT or ~/.cache/coldsnap)"
    )
    add_json_option(p)
    p.set_defaults(func=run)
