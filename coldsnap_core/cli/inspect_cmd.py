"""``coldsnap inspect ARTIFACT [--json] [--state-root DIR]``: what an artifact holds, without reading the
payloads, and which capsule a restore on this node would use (``docs/format.md`` §15.4)."""

from __future__ import annotations

import argparse
from collections import defaultdict

from coldsnap_core.artifact.capsules import Capsule, find_worker
from coldsnap_core.artifact.derived_cache import verify_seed
from coldsnap_core.cli._output import add_command_options, report
from coldsnap_core.cli._targets import artifact_folder, resolve, restore_here
from coldsnap_core.errors import ColdsnapError
from coldsnap_core.format.descriptor import ArtifactDescriptor
from coldsnap_core.format.manifest import NativeManifest


def summarize(manifest: NativeManifest) -> dict[str, object]:
    """The inspect summary of one worker (the ``--json`` shape, documented in docs/format.md)."""
    stored = {(e.sha256, e.size_bytes) for e in manifest.model_extents}
    per_file: dict[str, dict[str, int]] = defaultdict(lambda: {"extents": 0, "bytes": 0, "dtype_converted": 0})
    for e in manifest.model_extents:
        entry = per_file[e.provenance.checkpoint_file]
        entry["extents"] += 1
        entry["bytes"] += e.size_bytes
        entry["dtype_converted"] += int(e.provenance.dtype_converted)
    by_tag: dict[str, int] = defaultdict(int)
    for a in manifest.allocations.allocations:
        by_tag[a.tag] += a.size_bytes
    return {
        "worker": manifest.worker.to_json(),
        "capsule": manifest.worker.capsule_name,
        "capture_point": manifest.capture_point,
        "layout_fingerprint": manifest.layout_fingerprint,
        "allocations": len(manifest.allocations),
        "allocation_bytes": manifest.allocations.total_bytes,
        "allocation_bytes_by_tag": dict(sorted(by_tag.items())),
        "tensors": sum(len(a.tensors) for a in manifest.allocations.allocations),
        "model_extents": len(manifest.model_extents),
        "model_bytes": manifest.model_bytes,
        "residual_extents": len(manifest.residual_extents),
        "residual_bytes": manifest.residual_bytes,
        "pack": {
            **manifest.pack.to_json(),
            "stored_extents": len(stored),
            "stored_bytes": sum(size for _, size in stored),
        },
        "residual": manifest.residual.to_json(),
        "provenance": dict(sorted(per_file.items())),
    }


def seed_summary(descriptor: ArtifactDescriptor, capsule: Capsule) -> dict[str, object]:
    """The capsule's derived-cache seed (``docs/format.md`` §17) as ``--json`` shows it (a refusal as ``error``)."""
    try:
        files = find_worker(descriptor, capsule.native.worker).capsule_files
        document = verify_seed(capsule.path, files)
    except ColdsnapError as exc:
        return {"present": True, "error": str(exc)}
    if document is None:
        return {"present": False}
    return {
        "present": True,
        "files": len(document.members),
        "size_bytes": document.size_bytes,
        "qualification": document.qualification.to_json(),
    }


def _seed_line(seed: dict[str, object]) -> str:
    if not seed["present"]:
        return "  derived-cache seed: none"
    if "error" in seed:
        return f"  derived-cache seed: refused, a start skips it: {seed['error']}"
    q = seed["qualification"]
    assert isinstance(q, dict) and isinstance(seed["size_bytes"], int)
    return (
        f"  derived-cache seed: {seed['files']} files, {_human(seed['size_bytes'])}, compiled by"
        f" {q['engine']} {q['engine_version']} with torch {q['torch_version']} on {q['device_type']}"
    )


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def run(args: argparse.Namespace) -> int:
    descriptor, capsules = resolve(args.artifact)
    summaries = [summarize(c.native) for c in capsules]
    for summary, capsule in zip(summaries, capsules, strict=True):
        summary["target"] = capsule.target.to_json() if capsule.target is not None else None
        if descriptor is not None:
            summary["restore_on_this_node"] = restore_here(artifact_folder(args.artifact), descriptor, capsule, args.state_root)
            summary["derived_cache"] = seed_summary(descriptor, capsule)
    model = descriptor.model if descriptor else capsules[0].recovery.model
    payloads = sorted({s["pack"]["sha256"] for s in summaries})
    doc = {"model": model.to_json(), "distinct_payloads": payloads, "workers": summaries}
    lines = [
        f"model: {model.source}" + (f" @ {model.revision}" if model.revision else ""),
        f"  configuration sha256 {model.config_sha256 or '(none: captured without an engine)'}",
        *(f"  checkpoint {f.name}: {_human(f.size_bytes)} sha256 {f.sha256}" for f in model.files),
        f"workers: {len(summaries)}, distinct payloads: {len(payloads)}",
    ]
    for s in summaries:
        pack = s["pack"]
        total = s["allocation_bytes"]
        lines += [
            f"\n{s['capsule']} ({s['capture_point']} capture point, layout {s['layout_fingerprint'][:16]})",
            f"  allocations: {s['allocations']} ({_human(total)}), tensors: {s['tensors']}",
            f"  model bytes:    {_human(s['model_bytes'])} in {s['model_extents']} extents ({100 * s['model_bytes'] / max(total, 1):.2f}%)",
            f"  residual bytes: {_human(s['residual_bytes'])} in {s['residual_extents']} extents",
            f"  pack: sha256 {pack['sha256']}",
            f"        {_human(pack['size_bytes'])}, {pack['stored_extents']} stored extents, path {pack['path']}",
            f"  residual blob: {s['residual']['file']} {_human(s['residual']['size_bytes'])} sha256 {s['residual']['sha256']}",
        ]
        target = s["target"]
        if target is not None:
            lines.append(
                f"  target: {target['engine']} {target['engine_version']}, torch {target['torch_version']}"
                f" (CUDA {target['torch_cuda_version']}), {target['device_type']}"
                + (f" {target['accelerator_model']}" if target["accelerator_model"] else "")
                + (f", NVIDIA driver {target['nvidia_driver_version']}" if target["nvidia_driver_version"] else "")
                + f", host {target['host']}"
            )
        if "restore_on_this_node" in s:
            here = s["restore_on_this_node"]
            where = {
                "portable": "portable capsule",
                "qualified": f"portable capsule, qualified for this target by {here['overlay']}",
                "overlay": f"overlay {here['overlay']}",
                None: "checkpoint load (auto) or refusal (native)",
            }[here["capsule"]]  # type: ignore[index]
            lines.append(f"  restore on this node ({here['engine']}): {where}: {here['reason']}")
        if "derived_cache" in s:
            lines.append(_seed_line(s["derived_cache"]))
        for name, p in s["provenance"].items():
            converted = f", {p['dtype_converted']} dtype-converted" if p["dtype_converted"] else ""
            lines.append(f"  provenance {name}: {p['extents']} extents, {_human(p['bytes'])}{converted}")
    return report(args, doc, lines)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="show allocations, model vs residual bytes, the pack digest and provenance",
        description="Summarize an artifact folder, a capsule folder or a native-manifest.json. Reads manifests only.",
    )
    p.add_argument("artifact", metavar="ARTIFACT", help="artifact folder, capsule folder or native-manifest.json")
    add_command_options(p, run, "the node-local state root whose overlays a restore would use")
