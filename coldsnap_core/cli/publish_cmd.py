"""``coldsnap publish-native ARTIFACT... --repo REPO``: upload each distinct model payload once, then each artifact's
own files and its name, and print the REF that ``coldsnap pull`` takes (the layout in REPO: ``docs/format.md`` §12).
A payload counts as present only if the store's object verifies as far as the store can tell (a corrupt one is
replaced); ``--dry-run`` checks by size (and the Hub's LFS SHA-256) only. Exit codes: ``docs/format.md`` §8."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cli._output import add_command_options, byte_bar, quiet_hub_bars, report
from coldsnap_core.cli._targets import artifact_folder
from coldsnap_core.stores import artifact_ref, parse_store_spec
from coldsnap_core.stores.publish import PublishedFile, PublishedPayload, artifact_listing, publish_native


def run(args: argparse.Namespace) -> int:
    store = parse_store_spec(args.repo, client=args.settings.store.client)
    if args.public:
        from coldsnap_core.stores.hf import HfPayloadStore  # only here: huggingface_hub is imported with it

        if isinstance(store, HfPayloadStore):
            store.private = False
    quiet_hub_bars()
    cache = PayloadCache(args.state_root, lock_timeout_seconds=args.lock_timeout_s)
    manifests: list[str] = []
    files: list[PublishedFile] = []
    folders = [artifact_folder(a) for a in args.artifact]

    def report_payload(item: PublishedPayload) -> None:
        bars.close()
        if not args.json:
            print(f"{item.action} {item.pack.sha256} ({item.pack.size_bytes} bytes) <- {', '.join(item.owners)}")

    def report_manifest(reference: str) -> None:
        manifests.append(reference)
        if not args.json:
            print(f"{store.record_kind} {reference}")

    with contextlib.ExitStack() as bars:  # each payload's bars, closed as it is reported
        results = publish_native(
            folders,
            store,
            cache,
            name=args.name,
            dry_run=args.dry_run,
            progress=lambda desc, total_bytes: bars.enter_context(byte_bar(desc, total_bytes)),
            on_payload=report_payload,
            on_file=files.append,
            on_artifact=report_manifest,
        )
    refs = [] if args.dry_run else [artifact_ref(args.repo, store, artifact_listing(f, args.name).name) for f in folders]
    counts = {action: sum(r.action == action for r in results) for action in ("uploaded", "present", "would-upload")}
    payloads = [
        {"action": r.action, "sha256": r.pack.sha256, "size_bytes": r.pack.size_bytes, "owners": list(r.owners)} for r in results
    ]
    published = [{"artifact": f.artifact, **dataclasses.asdict(f.file), "action": f.action} for f in files]
    doc = {
        "store": store.name,
        "dry_run": args.dry_run,
        "payloads": payloads,
        "files": published,
        "manifests": manifests,
        "refs": refs,
        "counts": counts,
    }
    lines = []
    for name in dict.fromkeys(f.artifact for f in files):  # one line per artifact: its files are small and many
        mine = [f for f in files if f.artifact == name]
        actions = ", ".join(f"{sum(f.action == a for f in mine)} {a}" for a in ("uploaded", "present", "would-upload"))
        lines.append(f"files {name}: {len(mine)} ({actions})")
    done = f"ok: {len(results)} distinct payload(s) -> {store.name}: {counts['uploaded']} uploaded, "
    done += f"{counts['present']} already present"
    if args.dry_run:
        done += f", {counts['would-upload']} would be uploaded"
    return report(args, doc, [*lines, *(f"ref {ref}" for ref in refs)], done)


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
        help="the artifact's name in the store (one ARTIFACT only; default: its folder's name): refs/NAME.json, or the OCI"
        " tag when REPO has none",
    )
    p.add_argument(
        "--public", action="store_true", help="create a missing Hugging Face repository public (default: private, as hf upload)"
    )
    p.add_argument("--dry-run", action="store_true", help="check presence and local objects; hash and upload nothing")
    add_command_options(p, run)
