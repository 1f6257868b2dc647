"""``coldsnap verify ARTIFACT``: check every rule over every byte of every worker's payloads.

Order (each step raises the first failure it finds; ``docs/format.md``, "Verification rules"):

1. resolve ``ARTIFACT`` (artifact folder, capsule folder or ``native-manifest.json``) and parse every
   document strictly; each capsule of an artifact matches its pins in ``artifact.json`` (both
   manifests, the residual blob's digest) and names the worker and payload of its entry; a capsule's
   folder is named after its manifests' worker;
2. for an artifact folder, every capsule folder is listed in ``artifact.json`` and every capsule's
   recovery manifest names the descriptor's model identity; every model extent comes from a
   checkpoint file of the model identity;
3. per worker, every manifest rule (:func:`coldsnap_core.verify.check_manifest`);
4. the cache folders are checked as the cache commands check them (no symbolic link at
   ``model-payloads/`` or below, :meth:`coldsnap_core.cache.PayloadCache.check_dirs`); per distinct
   pack, one full read (:func:`coldsnap_core.verify.verify_pack_file`): size, zero padding, every
   stored extent's SHA-256, the file's SHA-256; a symbolic link or non-regular file at the object
   path is refused;
5. per worker, the residual blob: size, then SHA-256.

Nothing is written (no validation record either): ``verify`` is a read-only audit.
Exit codes: 0 verified, 1 content mismatch or corruption, 2 malformed or unsupported manifest,
3 missing object, 4 other error.
"""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from coldsnap_core.artifact import check_artifact_layout, check_provenance_in_identity
from coldsnap_core.cache import PayloadCache, refuse_symlink
from coldsnap_core.cli._targets import artifact_folder, resolve
from coldsnap_core.errors import ManifestMismatchError
from coldsnap_core.verify import check_manifest, extent_owner_map, verify_blob_file, verify_pack_file


def run(args: argparse.Namespace) -> int:
    cache = PayloadCache(args.state_root)
    descriptor, capsules = resolve(args.artifact)
    if descriptor is not None:
        check_artifact_layout(artifact_folder(args.artifact))
        for capsule in capsules:
            if descriptor.model != capsule.recovery.model:
                raise ManifestMismatchError(
                    "artifact.json names another model identity than the capsule's recovery manifest", file=capsule.path
                )
    for capsule in capsules:
        model = descriptor.model if descriptor is not None else capsule.recovery.model
        check_provenance_in_identity(capsule.native, model, file=str(capsule.native_manifest_path))
    layouts = [check_manifest(c.native, file=str(c.native_manifest_path)) for c in capsules]
    cache.check_dirs()
    verified_packs: set[str] = set()
    for capsule, layout in zip(capsules, layouts, strict=True):
        manifest = capsule.native
        if manifest.pack.sha256 not in verified_packs:
            path = cache.object_path(manifest.pack.sha256)
            refuse_symlink(path)
            with tqdm(
                total=manifest.pack.size_bytes,
                unit="B",
                unit_scale=True,
                desc=f"verify {manifest.pack.sha256[:12]}",
                leave=False,
                disable=None,
            ) as bar:
                verify_pack_file(
                    path,
                    manifest.pack,
                    layout,
                    progress=bar.update,
                    extent_owner=extent_owner_map(manifest),
                    manifest_file=str(capsule.native_manifest_path),
                )
            verified_packs.add(manifest.pack.sha256)
        verify_blob_file(capsule.blob_path, manifest.residual)
        print(
            f"{manifest.worker.capsule_name}: verified pack {manifest.pack.sha256} ({manifest.pack.size_bytes} bytes, "
            f"{len(manifest.model_extents)} model extents) and residual blob ({manifest.residual.size_bytes} bytes)"
        )
    print(f"ok: {len(capsules)} worker(s), {len(verified_packs)} distinct payload(s)", file=sys.stderr)
    return 0


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
    p.add_argument("--state-root", default=None, help="where packs live (default: $COLDSNAP_STATE_ROOT or ~/.cache/coldsnap)")
    p.set_defaults(func=run)
