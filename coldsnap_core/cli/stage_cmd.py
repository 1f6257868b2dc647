"""``coldsnap stage ARTIFACT [--rank N ...]``: put this host's packs into the node-local cache, verified (exit codes:
``docs/format.md`` §8)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from coldsnap_core._io import lstat_or_none
from coldsnap_core.artifact.capsules import read_descriptor
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cache.records import record_state
from coldsnap_core.cli._output import add_command_options, byte_bar, quiet_hub_bars, report
from coldsnap_core.cli._targets import artifact_folder
from coldsnap_core.errors import ColdsnapError, ConfigurationError, MissingObjectError
from coldsnap_core.format.descriptor import WorkerEntry
from coldsnap_core.format.manifest import PackRef, WorkerIdentity
from coldsnap_core.restore.staging import stage_payload, worker_entries
from coldsnap_core.stores import from_settings, parse_store_spec
from coldsnap_core.stores.base import PayloadStore


def _env_int(environ: Mapping[str, str], *names: str) -> tuple[str, int] | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            try:
                return name, int(value)
            except ValueError:
                raise ConfigurationError(f"{name}={value!r} is not an integer") from None
    return None


def host_workers(
    workers: Sequence[WorkerIdentity],
    *,
    ranks: Sequence[int] | None = None,
    node_rank: int | None = None,
    workers_per_node: int | None = None,
    environ: Mapping[str, str] | None = None,
    descriptor_file: str | os.PathLike[str] | None = None,
) -> list[WorkerIdentity]:
    """The workers of ``workers`` (an artifact's, in its order) that run on this host: the ``ranks``; else, with a node
    rank K and W workers per node (arguments, else torchrun's ``NODE_RANK`` (or ``GROUP_RANK``) and
    ``LOCAL_WORLD_SIZE``), ranks ``K*W`` to ``K*W+W-1`` (``torch.distributed`` numbers ranks node by node); else all.

    Raises:
        MissingObjectError: a requested rank is not in the artifact, or node ``K`` has no worker.
        ConfigurationError: only one of node rank and workers per node is known, or one is negative
            or not an integer (names the variable).
    """
    if ranks:
        missing = sorted(set(ranks) - {w.rank for w in workers})
        if missing:
            raise MissingObjectError(
                f"the artifact lists no worker with rank {', '.join(map(str, missing))}", file=descriptor_file
            )
        return [w for w in workers if w.rank in set(ranks)]
    env = os.environ if environ is None else environ
    node = ("--node-rank", node_rank) if node_rank is not None else _env_int(env, "NODE_RANK", "GROUP_RANK")
    per_node = ("--workers-per-node", workers_per_node) if workers_per_node is not None else _env_int(env, "LOCAL_WORLD_SIZE")
    if node is None and per_node is None:
        return list(workers)
    if node is None or per_node is None:
        given = (node or per_node)[0]
        raise ConfigurationError(
            f"{given} is set but not {'LOCAL_WORLD_SIZE/--workers-per-node' if node else 'NODE_RANK/--node-rank'}: "
            "both say which ranks run on this host"
        )
    if node[1] < 0 or per_node[1] <= 0:
        raise ConfigurationError(f"{node[0]}={node[1]} must be >= 0 and {per_node[0]}={per_node[1]} > 0")
    first = node[1] * per_node[1]
    mine = [w for w in workers if first <= w.rank < first + per_node[1]]
    if not mine:
        raise MissingObjectError(
            f"node {node[1]} with {per_node[1]} workers per node runs ranks {first}-{first + per_node[1] - 1}; "
            "the artifact lists none of them",
            file=descriptor_file,
        )
    return mine


def this_host_entries(args: argparse.Namespace, artifact_dir: Path) -> list[WorkerEntry]:
    """The ``artifact.json`` entries of this host's workers (:func:`host_workers` of :func:`add_host_options`)."""
    descriptor = read_descriptor(artifact_dir)
    workers = host_workers(
        [entry.worker for entry in descriptor.workers],
        ranks=args.rank,
        node_rank=args.node_rank,
        workers_per_node=args.workers_per_node,
        descriptor_file=artifact_dir / "artifact.json",
    )
    return worker_entries(artifact_dir, workers)


def add_host_options(p: argparse.ArgumentParser, verb: str) -> None:
    """``--rank``, ``--node-rank``, ``--workers-per-node``: which workers run on this host (:func:`host_workers`)."""
    p.add_argument(
        "--rank",
        type=int,
        action="append",
        metavar="N",
        help=f"{verb} only the worker with this rank (repeatable; default: this host's workers, see above)",
    )
    p.add_argument("--node-rank", type=int, metavar="K", help="this host's node rank (default: $NODE_RANK/$GROUP_RANK)")
    p.add_argument("--workers-per-node", type=int, metavar="W", help="workers per host (default: $LOCAL_WORLD_SIZE)")


def _stage_one(pack: PackRef, cache: PayloadCache, store: PayloadStore | None, fetched: set[str]) -> Path:
    """Stage ``pack`` (a progress bar unless its record is trusted); adds its digest to ``fetched`` if the store was asked."""
    try:
        trusted = record_state(cache, pack.sha256) == "trusted"
        cached = lstat_or_none(cache.object_path(pack.sha256)) is not None
    except ColdsnapError:  # a cache path that cannot be examined: stage_payload raises what is wrong with it
        trusted = cached = False
    contacted = lambda _: fetched.add(pack.sha256)  # noqa: E731
    if trusted:
        return stage_payload(pack, cache=cache, store=store, fetched=contacted)
    desc = f"stage {pack.sha256[:12]}" + ("" if cached else " (fetch and hash)")
    with byte_bar(desc, pack.size_bytes) as update:
        return stage_payload(pack, cache=cache, store=store, progress=update, fetched=contacted)


def stage_entries(
    entries: Sequence[WorkerEntry], cache: PayloadCache, store: PayloadStore | None, fetched: set[str] | None = None
) -> dict[str, Path]:
    """Stage each distinct pack of ``entries`` once; returns its staged path by digest."""
    staged: dict[str, Path] = {}
    for entry in entries:
        if entry.payload.sha256 not in staged:
            staged[entry.payload.sha256] = _stage_one(entry.payload, cache, store, set() if fetched is None else fetched)
    return staged


def staged_from(store: PayloadStore | None, staged: int, fetched: int) -> str:
    """Where ``staged`` distinct packs came from, ``fetched`` of them from ``store`` (named only when it sent one)."""
    if store is None:
        return f"{staged} distinct pack(s) staged from the node-local cache (no payload store configured)"
    if fetched == 0:
        return f"{staged} distinct pack(s) already cached, store not contacted ({store.name})"
    cached = f", {staged - fetched} already cached" if staged > fetched else ""
    return f"{staged} distinct pack(s) staged: {fetched} fetched from {store.name}{cached}"


def add_repo_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--repo",
        help="payload store: a folder path, s3://bucket/prefix, oci://host/ns/name, gs://bucket/prefix, "
        "az://account/container/prefix (or an Azure connection string) or a Hugging Face repo id org/name[@revision] "
        "(default: $COLDSNAP_PAYLOAD_DIR or $COLDSNAP_PAYLOAD_REPO)",
    )


def store_of(args: argparse.Namespace) -> PayloadStore | None:
    """The store ``--repo`` names, else the one the settings configure (``None``: none)."""
    client = args.settings.store.client
    return parse_store_spec(args.repo, client=client) if args.repo else from_settings(args.settings.store)


def staged_workers(entries: Sequence[WorkerEntry], staged: Mapping[str, Path]) -> list[dict[str, str]]:
    """``--json``'s ``workers``: each entry's capsule name, pack digest and staged path."""
    return [{"capsule": e.worker.capsule_name, "pack": e.payload.sha256, "path": str(staged[e.payload.sha256])} for e in entries]


def run(args: argparse.Namespace) -> int:
    artifact_dir = artifact_folder(args.artifact)
    cache = PayloadCache(args.state_root, lock_timeout_seconds=args.lock_timeout_s)
    store = store_of(args)
    quiet_hub_bars()
    entries = this_host_entries(args, artifact_dir)
    fetched: set[str] = set()
    staged = stage_entries(entries, cache, store, fetched)
    workers = staged_workers(entries, staged)
    doc = {
        "staged": True,
        "store": store.name if store is not None else None,
        "workers": workers,
        "distinct_packs": len(staged),
        "fetched_packs": len(fetched),
    }
    done = f"ok: {len(entries)} worker(s), {staged_from(store, len(staged), len(fetched))}"
    return report(args, doc, [f"{w['capsule']}: {w['path']}" for w in workers], done)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "stage",
        help="stage (and verify) the packs of this host's workers into the node-local cache",
        description=(
            "For each of this host's workers in ARTIFACT, make its pack available in <state-root>/model-payloads: from the cache "
            "(validation record or full SHA-256), else from the payload store (--repo, COLDSNAP_PAYLOAD_DIR or "
            "COLDSNAP_PAYLOAD_REPO). Exit codes: 0 staged, 1 corrupt pack, 2 malformed manifest, 3 pack unavailable or "
            "unknown rank, 4 other error (including a store that did not answer). This host's workers: the --rank values; "
            "else, with --node-rank K and --workers-per-node W (default: $NODE_RANK or $GROUP_RANK, and $LOCAL_WORLD_SIZE, "
            "as torchrun sets them), ranks K*W to K*W+W-1; else every worker in artifact.json (one host runs them all)."
        ),
    )
    p.add_argument("artifact", metavar="ARTIFACT", help="artifact folder (with artifact.json), or its artifact.json")
    add_host_options(p, "stage")
    add_repo_option(p)
    add_command_options(p, run)
