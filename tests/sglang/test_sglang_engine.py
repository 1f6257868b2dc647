"""End to end on the real SGLang engine (sglang 0.5.23 on the CPU) with the real SmolLM2 checkpoints.

Every engine runs in its own process with the SGLang virtual environment's Python
(``sglang_support.run_sglang``); the comparisons use SGLang's own weights checker (per parameter and
persistent buffer, the first 8 bytes of the SHA-256 of its bytes) against a plain ``--load-format
safetensors`` load, and greedy generations. Engine starts cost 30-47 s each on two cores, so one capture
of the 2-layer checkpoint serves every check of this module (a fixture of module scope): plain load,
capture, native restore through ``python -m sglang.launch_server``, a flipped pack byte under ``auto``,
``COLDSNAP_MATERIALIZE=async``, and (in a copy of its artifact and state root) a capsule recorded under another
SGLang version, which falls back once and captures a target-local overlay; vLLM's runs are the session's
(``vllm_two_layer`` in ``tests/conftest.py``). Each refusal rule family keeps one end-to-end case (corruption:
the flipped byte under ``auto``; target: vLLM's artifact under ``native`` and ``auto``; configuration:
``COLDSNAP_MATERIALIZE=async``); their other cases are asserted in process (``tests/sglang/test_sglang_plugin.py``,
``tests/restore``). The 3-shard and untied checkpoints get their own capture and
restore, and so does tensor parallel size 3 (one worker and pack per rank).

The engine contract's conformance cases (``tests/conformance/suite.py``) run on this module's runs
(``TestSglangConformance``): the runs some tests make are module fixtures for that, so no engine starts twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from sglang_support import PROMPTS, SGLangResult, check_sglang_loader, coldsnap_env, run_sglang, sglang_env, sglang_python

from coldsnap_core.artifact.capsules import read_capsule, read_descriptor
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.stores.local import LocalFolderStore
from coldsnap_core.stores.publish import publish_native
from tests.conformance.suite import EngineConformance, EngineRuns, Start
from tests.support.engine_marker import require_engine_marker
from tests.support.outcome_lines import appended_lines, outcome_log_of
from tests.support.servers import free_port, scraped, stop_server

pytestmark = [pytest.mark.engine, pytest.mark.sglang]

WORKER = "worker-0-of-1"
SMOLLM2_2LAYER_PACK_SHA256 = "b5a02a03cd57b72df32f33a3822006fb012818690d609dfca6a8e0265a05d407"  # vLLM's too
STARTUP_TIMEOUT_SECONDS = 600


def _only_pack(state: Path) -> Path:
    (pack,) = sorted((state / "model-payloads" / "sha256").glob("*.pack"))
    return pack


def _flip_byte(path: Path, offset: int) -> None:
    path.chmod(0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0x01]))
    path.chmod(0o444)


def _http(url: str, body: dict | None = None, timeout: float = 5) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
        return 0, None


def _serve_restore(work: Path, model: Path, env: dict[str, str]) -> SGLangResult:
    """``python -m sglang.launch_server ... --load-format coldsnap --enable-metrics`` with ``env``: wait for
    ``/health``, send one ``/generate`` request with both prompts, read ``/weights_checker`` (``action=checksum``)
    and ``/metrics``, stop the server with SIGINT; the result in :class:`SGLangResult` form (``output_ids`` from
    ``/generate``)."""
    require_engine_marker("sglang.launch_server")
    port = free_port()
    command = [str(sglang_python()), "-m", "sglang.launch_server", "--model-path", str(model)]
    command += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--tp-size", "1"]
    command += ["--dtype", "bfloat16", "--mem-fraction-static", "0.1", "--context-length", "256", "--max-total-tokens", "2048"]
    command += [
        "--skip-server-warmup",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load-format",
        "coldsnap",
        "--random-seed",
        "0",
        "--enable-metrics",
    ]
    log_path = work / "server.log"
    answer, checksums, metrics = None, None, ""
    with open(log_path, "w") as log, appended_lines(outcome_log_of(env)) as lines:
        server = subprocess.Popen(
            command, env=sglang_env(work / "server.tmp", env), stdout=log, stderr=subprocess.STDOUT, cwd=work
        )
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
            while _http(f"http://127.0.0.1:{port}/health")[0] != 200:
                if server.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(1)
            else:
                body = {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
                _, answer = _http(f"http://127.0.0.1:{port}/generate", body, timeout=300)
                _, checksums = _http(f"http://127.0.0.1:{port}/weights_checker", {"action": "checksum"}, timeout=300)
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
                    metrics = response.read().decode()
        finally:
            stop_server(server)
    log_text = log_path.read_text()
    if not isinstance(answer, list) or not isinstance(checksums, dict):
        return SGLangResult(server.returncode or 1, [], [], [], log_text, tuple(lines))
    return SGLangResult(
        0,
        [a["text"] for a in answer],
        [a["output_ids"] for a in answer],
        [r["checksums"] for r in sorted(checksums["ranks"], key=lambda r: r["parallelism_info"][0]["tp_rank"])],
        log_text,
        tuple(lines),
        metrics,
    )


@pytest.fixture(scope="module")
def two_layer(smollm2_2layer: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A plain SGLang load, a capture (``COLDSNAP_EXPORT_MODEL_PAYLOAD=1``) and a native restore in a
    fresh engine (``python -m sglang.launch_server``, :func:`_serve_restore`), of the 2-layer checkpoint."""
    sglang_python()  # skip before any work without the SGLang virtual environment
    work = tmp_path_factory.mktemp("sglang-two-layer")
    runs = {"work": work, "model": smollm2_2layer, "artifact": work / "artifact", "state": work / "state"}
    runs["plain"] = run_sglang(work, "plain", smollm2_2layer, "safetensors")
    env = coldsnap_env(runs["artifact"], runs["state"])
    runs["capture"] = run_sglang(work, "capture", smollm2_2layer, "coldsnap", env={**env, "COLDSNAP_EXPORT_MODEL_PAYLOAD": "1"})
    runs["restore"] = _serve_restore(work, smollm2_2layer, {**env, "COLDSNAP_RESTORE": "native"})
    return runs


def _assert_same_load(result, plain) -> None:
    assert result.started, result.log[-5000:]
    assert plain.started, plain.log[-5000:]
    assert len(plain.checksums[0]) >= 14
    different = sorted(n for n in plain.checksums[0] if result.checksums[0].get(n) != plain.checksums[0][n])
    assert set(result.checksums[0]) == set(plain.checksums[0]) and different == [], different
    assert result.output_ids == plain.output_ids and result.outputs == plain.outputs


def test_capture_then_restore_equals_a_plain_sglang_load(two_layer: dict, smollm2_2layer: Path) -> None:
    """Capture inside SGLang, then a native restore in a fresh engine started as ``python -m
    sglang.launch_server ... --load-format coldsnap`` (its scheduler loads the plugin through the
    ``sglang.srt.plugins`` entry point): every parameter's bytes (SGLang's ``/weights_checker``) and the
    greedy tokens of one ``/generate`` request equal a plain SGLang load; the capture run (the observed load)
    changed nothing either. The capsule holds every checkpoint byte as model bytes (the tied ``lm_head``
    once), its pack is the 2-layer golden digest, and the restore read no checkpoint; SGLang's own ``/metrics``
    (``--enable-metrics``) counts the restore with its seconds and hydrated bytes. Fails if SGLang's
    capture misclassifies a write, if restore hydrates other bytes, if the entry point does not register in
    the scheduler, if the loader falls back to the checkpoint, or if the scheduler's load does not reach SGLang's
    multiprocess registry."""
    from coldsnap_core.format.safetensors_header import read_header

    plain, capture, restore = two_layer["plain"], two_layer["capture"], two_layer["restore"]
    _assert_same_load(capture, plain)
    _assert_same_load(restore, plain)
    assert [line for line in capture.coldsnap_lines() if f"captured {WORKER}: 70784640 model bytes" in line]
    assert [line for line in restore.coldsnap_lines() if f"restored {WORKER} from pack" in line]
    assert [line for line in restore.coldsnap_lines() if "could not restore" in line] == []
    header = read_header(smollm2_2layer / "model.safetensors")
    native = read_capsule(two_layer["artifact"] / "workers" / WORKER).native
    assert native.model_bytes == sum(t.size_bytes for t in header.values()) == 70_784_640
    assert {e.provenance.tensor_name for e in native.model_extents} == set(header)
    assert native.capture_point == "portable"
    assert native.pack.sha256 == SMOLLM2_2LAYER_PACK_SHA256
    sglang = {"engine": "sglang"}
    assert scraped(restore.metrics, "coldsnap_load_total", **sglang, outcome="restored", rule="") == 1, restore.metrics
    assert scraped(restore.metrics, "coldsnap_load_seconds_count", **sglang, outcome="restored") == 1
    assert scraped(restore.metrics, "coldsnap_hydrated_bytes_total", **sglang) == native.model_bytes + native.residual_bytes


def test_sglang_and_vllm_captures_name_the_same_pack(two_layer: dict, vllm_two_layer: dict, tmp_path: Path) -> None:
    """The model bytes of one checkpoint are the same in both engines, so vLLM's capture of the 2-layer
    checkpoint (in this test run: the session's, ``vllm_two_layer`` in ``tests/conftest.py``) gives the pack digest SGLang's capture gave, with byte-identical pack
    files; each engine keeps its own capsule (the residual and the allocation layout differ: vLLM has 4
    attention scales per layer more). Fails if either engine's capture orders or classifies model bytes
    differently. Publishing both artifacts uploads that pack once."""
    vllm = vllm_two_layer["capture"]
    assert vllm.error is None, vllm.error
    vllm_artifact, vllm_state = vllm_two_layer["artifact"], vllm_two_layer["state"]
    sglang_pack = read_descriptor(two_layer["artifact"]).workers[0].payload
    vllm_pack = read_descriptor(vllm_artifact).workers[0].payload
    assert sglang_pack == vllm_pack and vllm.outcome["pack"] == sglang_pack.sha256
    assert _only_pack(two_layer["state"]).read_bytes() == _only_pack(vllm_state).read_bytes()
    sglang_native = read_capsule(two_layer["artifact"] / "workers" / WORKER).native
    vllm_native = read_capsule(vllm_artifact / "workers" / WORKER).native
    assert len(sglang_native.allocations.allocations) < len(vllm_native.allocations.allocations)
    # Publication of both engines' artifacts uploads the shared pack once, owned by both capsules.
    (published,) = publish_native(
        [two_layer["artifact"], vllm_artifact], LocalFolderStore(tmp_path / "store"), PayloadCache(two_layer["state"])
    )
    assert published.action == "uploaded" and published.pack == sglang_pack and len(published.owners) == 2


@pytest.fixture(scope="module")
def vllm_artifact(two_layer: dict, vllm_two_layer: dict) -> dict[str, SGLangResult]:
    """SGLang given vLLM's artifact of the same checkpoint (a copy of vLLM's state root): ``native`` and ``auto``."""
    artifact = vllm_two_layer["artifact"]
    state = Path(shutil.copytree(vllm_two_layer["state"], two_layer["work"] / "vllm-state", symlinks=True))
    runs = {}
    for mode in ("native", "auto"):
        env = coldsnap_env(artifact, state, **({"COLDSNAP_RESTORE": "native"} if mode == "native" else {}))
        runs[mode] = run_sglang(two_layer["work"], f"vllm-artifact-{mode}", two_layer["model"], "coldsnap", env=env)
    return runs


def test_a_vllm_artifact_is_refused_by_sglang_naming_vllm(two_layer: dict, vllm_artifact: dict) -> None:
    """vLLM's artifact of the very checkpoint SGLang loads (same pack): ``native`` stops the SGLang engine
    with the target qualification error (``TargetMismatchError``, rule ``target-qualification``) that names vLLM as the
    capturing engine and SGLang as this one, not a layout count; ``auto`` logs exactly one coldsnap
    WARNING saying the same and then serves SGLang's checkpoint load, equal to a plain load. Fails if
    SGLang replays another engine's capsule, or refuses it for a reason that does not name the engine
    (the allocation layout, 303 against 183 allocations, or the configuration digest)."""
    why = "the capsule was captured by vllm 0."
    native = vllm_artifact["native"]
    assert not native.started and native.outputs == []
    refusals = [line for line in native.log.splitlines() if "TargetMismatchError: rule target-qualification failed" in line]
    assert refusals and all(why in line and "this engine is sglang 0.5.23" in line for line in refusals), native.log[-5000:]
    assert "could not restore" not in native.log  # native never falls back
    auto = vllm_artifact["auto"]
    _assert_same_load(auto, two_layer["plain"])
    (warning,) = [line for line in auto.coldsnap_lines() if "could not restore" in line]
    assert f"could not restore {WORKER}" in warning and why in warning and "this engine is sglang 0.5.23" in warning


def test_an_sglang_artifact_is_refused_by_vllm_naming_sglang(two_layer: dict, vllm_two_layer: dict) -> None:
    """The reverse: SGLang's artifact given to vLLM with ``COLDSNAP_RESTORE=native``: the engine does not
    start, and the error is the target qualification naming SGLang as the capturing engine and vLLM as this
    one. Fails if vLLM replays SGLang's capsule or refuses it by its allocation count instead of by engine."""
    from engine_support import run_engine  # on sys.path through vllm_two_layer

    refused = run_engine(
        vllm_two_layer["work"],
        "sglang-artifact-native",
        two_layer["model"],
        "coldsnap",
        env=coldsnap_env(two_layer["artifact"], two_layer["state"], COLDSNAP_RESTORE="native"),
    )
    assert refused.error is not None and refused.outputs == []
    assert "TargetMismatchError" in refused.error and "rule target-qualification failed" in refused.error, refused.error
    assert "the capsule was captured by sglang 0.5.23; this engine is vllm 0." in refused.error, refused.error


def _flipped_state(two_layer: dict, name: str) -> tuple[Path, tuple[int, int]]:
    """A copy of the capture's state root with one byte flipped inside the largest model extent."""
    state = Path(shutil.copytree(two_layer["state"], two_layer["work"] / name, symlinks=True))
    manifest = read_capsule(two_layer["artifact"] / "workers" / WORKER).native
    extent = max(manifest.model_extents, key=lambda e: e.size_bytes)
    _flip_byte(_only_pack(state), extent.pack_offset_bytes + 12345)
    return state, (extent.allocation_index, extent.offset_bytes)


@pytest.fixture(scope="module")
def flipped_auto(two_layer: dict) -> SGLangResult:
    """An ``auto`` start on a copy of the capture's state root with one flipped pack byte."""
    state, _ = _flipped_state(two_layer, "state-flipped-auto")
    env = coldsnap_env(two_layer["artifact"], state)
    return run_sglang(two_layer["work"], "flipped-auto", two_layer["model"], "coldsnap", env=env)


def test_flipped_pack_byte_auto_warns_once_and_serves_correctly(two_layer: dict, flipped_auto: SGLangResult) -> None:
    """``auto`` with one flipped pack byte: exactly one coldsnap WARNING carrying the verifier's rule
    (``extent-sha256``), then SGLang's checkpoint load, which serves the plain load's bytes and tokens.
    Fails if SGLang would serve the corrupt pack or fall back silently."""
    result = flipped_auto
    _assert_same_load(result, two_layer["plain"])
    (warning,) = [line for line in result.coldsnap_lines() if "could not restore" in line]  # SGLang logs no level name
    assert f"could not restore {WORKER}" in warning and "rule extent-sha256 failed" in warning


def test_a_tensor_stored_in_two_shards_names_the_single_file_pack(
    two_layer: dict, smollm2_2layer_duplicated_embedding: Path, tmp_path: Path
) -> None:
    """An SGLang capture of the 2-layer checkpoint whose embedding is stored again, byte for byte, in a second
    shard (SGLang's loader reads every shard, so the name is copied twice): the pack is the single-file
    golden digest with the single-file residual size and model bytes, and the generations equal a plain load's. Fails if a name found in two files loses its provenance in SGLang's
    path (``LoadSession``)."""
    artifact = tmp_path / "artifact"
    env = coldsnap_env(artifact, tmp_path / "state", COLDSNAP_EXPORT_MODEL_PAYLOAD="1")
    result = run_sglang(tmp_path, "capture-duplicated", smollm2_2layer_duplicated_embedding, "coldsnap", env=env)
    assert result.started, result.log[-5000:]
    native = read_capsule(artifact / "workers" / WORKER).native
    assert native.pack.sha256 == SMOLLM2_2LAYER_PACK_SHA256
    assert native.residual_bytes == read_capsule(two_layer["artifact"] / "workers" / WORKER).native.residual_bytes
    assert [line for line in result.coldsnap_lines() if "captured worker-0-of-1: 70784640 model bytes" in line]
    assert [line for line in result.coldsnap_lines() if "could not" in line] == []
    assert result.output_ids == two_layer["plain"].output_ids


@pytest.fixture(scope="module")
def materialize_async(two_layer: dict) -> SGLangResult:
    """A start with ``COLDSNAP_MATERIALIZE=async``, which SGLang's adapter cannot honour."""
    env = coldsnap_env(two_layer["artifact"], two_layer["state"], COLDSNAP_MATERIALIZE="async")
    return run_sglang(two_layer["work"], "materialize-async", two_layer["model"], "coldsnap", env=env)


def test_materialize_async_and_required_are_refused_under_sglang(two_layer: dict, materialize_async: SGLangResult) -> None:
    """``COLDSNAP_MATERIALIZE=async`` stops a real SGLang engine before it loads anything, the error naming
    the setting; ``required`` is refused the same way by SGLang's own ``LoadConfig`` and
    ``get_model_loader`` (no engine start needed to reach the loader's constructor). Fails if SGLang
    silently ignores a materialization mode it does not implement."""
    result = materialize_async
    assert not result.started
    assert "ConfigurationError: rule configuration failed: COLDSNAP_MATERIALIZE=async is not supported with SGLang" in result.log
    answer = check_sglang_loader(two_layer["work"], "materialize-required", {"materialize": "required"})
    assert answer.get("refused", answer).startswith(
        "rule configuration failed: COLDSNAP_MATERIALIZE=required is not supported with SGLang"
    ), answer


def _edit_target(artifact: Path, **fields) -> None:
    """Edit the capsule's ``target.json`` and re-pin every capsule file in ``artifact.json`` (an edit a
    re-signing operator would make), as ``tests/vllm/test_vllm_target.py`` does for vLLM."""
    target = artifact / "workers" / WORKER / "target.json"
    target.write_text(json.dumps({**json.loads(target.read_text()), **fields}, indent=2, sort_keys=True) + "\n")
    doc = json.loads((artifact / "artifact.json").read_text())
    for entry in doc["workers"]:
        for pin in entry["capsule_files"]:
            data = (artifact / entry["capsule"] / pin["name"]).read_bytes()
            pin.update(size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (artifact / "artifact.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


@pytest.fixture(scope="module")
def another_version(two_layer: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A copy of the module's capture whose ``target.json`` records SGLang 0.5.22: two ``auto`` starts on it (``first``,
    ``second``), appending to the outcome log ``log``; ``state``: their state root, whose overlays after the first
    start are ``overlays-after-first``."""
    from coldsnap_core.cache.overlays import list_overlays

    work = tmp_path_factory.mktemp("sglang-another-version")
    artifact, state, log = work / "artifact", work / "state", work / "outcomes.jsonl"
    shutil.copytree(two_layer["artifact"], artifact)
    shutil.copytree(two_layer["state"], state)
    _edit_target(artifact, engine_version="0.5.22")
    env = coldsnap_env(artifact, state, COLDSNAP_OUTCOME_LOG=str(log))
    first = run_sglang(work, "other-version", two_layer["model"], "coldsnap", env=env)
    overlays = list_overlays(state)
    second = run_sglang(work, "through-overlay", two_layer["model"], "coldsnap", env=env)
    return {"first": first, "overlays-after-first": overlays, "second": second, "state": state, "log": log}


def test_a_capsule_of_another_sglang_version_falls_back_once_then_restores_through_an_overlay(
    two_layer: dict, another_version: dict
) -> None:
    """A copy of the module's capture whose ``target.json`` records another SGLang version: under ``auto``
    the first start falls back once (rule target-qualification) and, after its checkpoint load, captures this
    target's overlay (here a qualification record: SGLang's residual is the same on this runtime); the next
    start restores from the pack through that overlay without falling back. Both serve a plain load's
    bytes and tokens. Fails if every SGLang start after an upgrade falls back (no overlay was captured)."""
    first, log = another_version["first"], another_version["log"]
    _assert_same_load(first, two_layer["plain"])
    (warning,) = [line for line in first.coldsnap_lines() if "could not restore" in line]
    assert "rule target-qualification failed" in warning and "0.5.22" in warning
    (overlay,) = another_version["overlays-after-first"]
    assert overlay.descriptor.kind in ("overlay", "qualified")
    second = another_version["second"]
    _assert_same_load(second, two_layer["plain"])
    assert [line for line in second.coldsnap_lines() if "could not restore" in line] == []
    assert [line for line in second.coldsnap_lines() if f"restored {WORKER} from pack" in line]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(d["engine"], d["outcome"], d["rule"]) for d in lines] == [
        ("sglang", "fell-back", "target-qualification"),
        ("sglang", "restored", None),
    ]
    assert lines[1]["pack_sha256"] == SMOLLM2_2LAYER_PACK_SHA256


def test_a_sharded_untied_checkpoint_restores_equal_to_a_plain_load(smollm2_2layer_untied_3shards: Path, tmp_path: Path) -> None:
    """The untied 2-layer cut (an explicit ``lm_head.weight``) in 3 shards (``model.safetensors.index.json``):
    capture, restore in a fresh engine, compare with a plain load of it. Fails if SGLang's capture loses the
    provenance of a shard or of the separate ``lm_head``. (That a sharded checkpoint names the single-file
    pack is asserted in process: ``tests/core/test_capture_sensitivity.py``.)"""
    model = smollm2_2layer_untied_3shards
    plain = run_sglang(tmp_path, "plain", model, "safetensors")
    env = coldsnap_env(tmp_path / "artifact", tmp_path / "state")
    capture = run_sglang(tmp_path, "capture", model, "coldsnap", env={**env, "COLDSNAP_EXPORT_MODEL_PAYLOAD": "1"})
    restore = run_sglang(tmp_path, "restore", model, "coldsnap", env={**env, "COLDSNAP_RESTORE": "native"})
    _assert_same_load(capture, plain)
    _assert_same_load(restore, plain)
    assert [line for line in restore.coldsnap_lines() if f"restored {WORKER} from pack" in line]
    extents = read_capsule(tmp_path / "artifact" / "workers" / WORKER).native.model_extents
    assert {e.provenance.checkpoint_file for e in extents} == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    assert "lm_head.weight" in plain.checksums[0]
    assert "lm_head.weight" in {e.provenance.tensor_name for e in extents}


def _tensor_parallel_env(tp_size: int) -> dict[str, str]:
    """What SGLang 0.5.23 needs to start ``tp_size`` CPU ranks here: one OpenMP core list per rank
    (``SGLANG_CPU_OMP_THREADS_BIND``, ``|``-separated; ranks share cores when there are fewer cores than
    ranks) and ``SGLANG_NCCL_SO_PATH`` at no file, else PyPI's CUDA torch ships ``libnccl.so.2`` and SGLang's
    NCCL communicator refuses the CPU (``Expected a cuda device, but got: cpu``, ``pynccl.py``)."""
    cpus = sorted(os.sched_getaffinity(0))
    return {
        "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(cpus[rank % len(cpus)]) for rank in range(tp_size)),
        "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2",
    }


def test_tensor_parallel_3_each_rank_captures_and_restores_its_own_worker(smollm2_2layer: Path, tmp_path: Path) -> None:
    """SGLang at ``--tp-size 3`` (SmolLM2 has 9 heads): the capture writes one capsule per tensor parallel
    rank (``worker-<rank>-of-3``, from SGLang's ``LoadConfig.tp_rank``) with its own pack, three different
    digests (each rank holds its own shard of the model), and a native restore in a fresh engine fills
    every rank from its own worker: every rank's weights checksums and the greedy tokens equal a plain
    TP 3 load, with no checkpoint read. Fails if the ranks share a worker name (one capsule overwriting
    the others), if a rank restores another rank's capsule (its checksums then differ), or if a rank falls
    back to the checkpoint."""
    tp_env = _tensor_parallel_env(3)
    env = {**tp_env, **coldsnap_env(tmp_path / "artifact", tmp_path / "state")}
    plain = run_sglang(tmp_path, "plain", smollm2_2layer, "safetensors", env=tp_env, tp_size=3)
    capture = run_sglang(
        tmp_path, "capture", smollm2_2layer, "coldsnap", env={**env, "COLDSNAP_EXPORT_MODEL_PAYLOAD": "1"}, tp_size=3
    )
    restore = run_sglang(tmp_path, "restore", smollm2_2layer, "coldsnap", env={**env, "COLDSNAP_RESTORE": "native"}, tp_size=3)
    for result in (plain, capture, restore):
        assert result.started, result.log[-5000:]
        assert len(result.checksums) == 3, "one weights checksum list per tensor parallel rank"
    assert capture.checksums == plain.checksums and restore.checksums == plain.checksums
    assert capture.output_ids == plain.output_ids and restore.output_ids == plain.output_ids
    workers = [f"worker-{rank}-of-3" for rank in range(3)]
    assert sorted(p.name for p in (tmp_path / "artifact" / "workers").iterdir() if not p.name.startswith(".")) == workers
    packs = [read_capsule(tmp_path / "artifact" / "workers" / w).native.pack.sha256 for w in workers]
    assert len(set(packs)) == 3
    assert sorted(p.stem for p in (tmp_path / "state" / "model-payloads" / "sha256").glob("*.pack")) == sorted(packs)
    for worker, digest in zip(workers, packs, strict=True):
        assert [line for line in restore.coldsnap_lines() if f"restored {worker} from pack {digest[:12]}" in line], worker
    assert [line for line in restore.coldsnap_lines() if "could not restore" in line] == []


def _start(result: SGLangResult) -> Start:
    return Start(result.started, result.outcome_lines, result.log, result.checksums[0] if result.checksums else {})


@pytest.fixture(scope="module")
def runs(
    two_layer: dict, flipped_auto: SGLangResult, vllm_artifact: dict, another_version: dict, materialize_async
) -> EngineRuns:
    """This module's SGLang runs as the conformance cases read them (the refusal under ``native``: vLLM's artifact)."""
    return EngineRuns(
        engine="sglang",
        engine_label="SGLang",
        plain=_start(two_layer["plain"]),
        capture=_start(two_layer["capture"]),
        artifact=two_layer["artifact"],
        restore=_start(two_layer["restore"]),
        fallback=_start(flipped_auto),
        refusal=_start(vllm_artifact["native"]),
        upgraded=_start(another_version["first"]),
        through_overlay=_start(another_version["second"]),
        overlay_state=another_version["state"],
        unhonoured=_start(materialize_async),
        unhonoured_setting="COLDSNAP_MATERIALIZE=async",
    )


class TestSglangConformance(EngineConformance):
    """The engine contract's cases (``tests/conformance/suite.py``) on SGLang (:func:`runs`)."""
