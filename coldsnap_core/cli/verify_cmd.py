"""``coldsnap verify ARTIFACT``: check every rule over every byte of every worker's payloads, read only (no validation
record is written either; :func:`coldsnap_core.restore.audit.verify_capsules`). Exit codes: ``docs/format.md`` §8."""

from __future__ import annotations

import argparse

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cli._output import add_command_options, byte_bar, report
from coldsnap_core.cli._targets import artifact_folder, resolve
from coldsnap_core.restore.audit import VerifiedWorker, verify_capsules


def workers_json(verified: list[VerifiedWorker]) -> list[dict]:
    """``--json``'s ``workers``: per verified worker its capsule name, pack, model extent count and residual bytes."""
    return [
        {
            "capsule": w.worker.capsule_name,
            "pack": w.pack.to_json(),
            "model_extents": w.model_extents,
            "residual_bytes": w.residual_bytes,
        }
        for w in verified
    ]


def run(args: argparse.Namespace) -> int:
    cache = PayloadCache(args.state_root, lock_timeout_seconds=args.lock_timeout_s)
    descriptor, capsules = resolve(args.artifact)
    artifact_dir = artifact_folder(args.artifact) if descriptor is not None else None
    verified = verify_capsules(
        descriptor,
        capsules,
        cache=cache,
        artifact_dir=artifact_dir,
        progress_for=lambda pack: byte_bar(f"verify {pack.sha256[:12]}", pack.size_bytes),
    )
    doc = {"verified": True, "workers": workers_json(verified), "distinct_payloads": sorted({w.pack.sha256 for w in verified})}
    lines = [
        f"{w.worker.capsule_name}: verified pack {w.pack.sha256} ({w.pack.size_bytes} bytes, {w.model_extents} model"
        f" extents) and residual blob ({w.residual_bytes} bytes)"
        for w in verified
    ]
    return report(args, doc, lines, f"ok: {len(verified)} worker(s), {len(doc['distinct_payloads'])} distinct payload(s)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "verify",
        help="fully verify manifests, packs and residual blobs",
        description=(
            "Check every manifest rule, then read each pack once (size, zero padding, every extent's SHA-256, the file's "
            "SHA-256) and each residual blob (size, SHA-256). Read only. Exit codes: 0 verified, 1 content mismatch or "
            "corruption, 2 malformed or unsupported manifest, 3 missing object, 4 other error. Every failure names its "
            "rule, file, allocation and offset."
        ),
    )
    p.add_argument("artifact", metavar="ARTIFACT", help="artifact folder, capsule folder or native-manifest.json")
    add_command_options(p, run, "where packs live")
