"""Run one real SGLang engine (sglang 0.5.23 on the CPU) in this process and write what it did as JSON.

Run with the SGLang virtual environment's Python (``scripts/setup-sglang-venv.sh``), never inside pytest:
a scheduler that fails kills the process that created the ``sgl.Engine`` (SGLang's SIGQUIT handler calls
``kill_process_tree(include_parent=True)``, ``sglang/srt/entrypoints/engine.py``), so the caller reads this
process's log and exit status instead. ``tests/sglang/support`` must be first on ``PYTHONPATH`` (the
``sgl_kernel`` stand-in) and ``SGLANG_USE_CPU_ENGINE=1`` set (``sglang/srt/utils/common.py`` ``is_cpu()``).

Usage: ``python tests/sglang/sglang_run.py SPEC.json RESULT.json``, or forked from
``tests/support/engine_host.py`` after :func:`preload` (what the tests do), where SPEC has ``model``, ``load_format``
(``coldsnap``, ``safetensors``, ...) and optionally ``dtype`` (``bfloat16``), ``env`` (set before the engine
starts), ``extra_config`` (``--model-loader-extra-config``), ``prompts``, ``max_tokens`` (8), ``tp_size``
(1), ``skip_tokenizer_init`` (prompts are then lists of token ids), ``checksums`` (true) and
``fork_schedulers`` (false: SGLang's own spawn; the tests set it, see :func:`_fork_schedulers`); or only
``loader_check`` (an extra config for :func:`_loader_check`, whose answer is then RESULT). RESULT gets
``outputs`` (the greedy texts, or token ids without a tokenizer), ``output_ids`` (token ids) and ``checksums``
(SGLang's own weights checker, ``action=checksum``: for every parameter and persistent buffer the first 8
bytes of the SHA-256 of its bytes, ``sglang/srt/utils/weight_checker.py``; one dict per tensor parallel rank).
"""

from __future__ import annotations

import json
import os
import sys


def preload() -> None:
    """Import what the engine-creating process of every run imports (about 20 s here), for
    ``tests/support/engine_host.py``, which forks each run from a process that called this. SGLang still
    spawns its scheduler and detokenizer as fresh interpreters (``mp.set_start_method("spawn")`` in
    ``sglang/srt/entrypoints/engine.py``). Nothing here starts an engine or runs a tensor operation."""
    import importlib

    # The slowest imports of the engine-creating process first (``python -X importtime``, sglang 0.5.23).
    for module in (
        "sglang",
        "sglang.srt.managers.io_struct",
        "sglang.srt.entrypoints.engine",
        "sglang.srt.managers.data_parallel_controller",
        "sglang.srt.managers.tokenizer_manager",
        # what a forked scheduler and detokenizer (``fork_schedulers``) would otherwise import themselves
        "sglang.srt.managers.scheduler",
        "sglang.srt.managers.detokenizer_manager",
        "sglang.srt.model_executor.model_runner",
        "sglang.srt.model_loader.loader",
        "sglang.srt.models.llama",
    ):
        importlib.import_module(module)


def _fork_schedulers() -> None:
    """Make SGLang fork its scheduler and detokenizer processes from this one instead of spawning fresh
    interpreters: ``_set_envs_and_config`` in ``sglang/srt/entrypoints/engine.py`` calls
    ``mp.set_start_method("spawn", force=True)``, which is turned into ``"fork"`` here. On the CPU nothing
    needs spawn's fresh interpreter (spawn is for CUDA, which cannot be forked once initialized), and each
    child then starts with SGLang imported (about 15 s of import per child saved here). Only for test
    engines: ``python -m sglang.launch_server`` (the CLI tests) keeps SGLang's own spawn, so the plugin's
    registration in a fresh scheduler interpreter stays covered."""
    import multiprocessing

    set_start_method = multiprocessing.set_start_method

    def fork_instead(method: str | None, force: bool = False) -> None:
        set_start_method("fork", force=True)

    multiprocessing.set_start_method = fork_instead


def _loader_check(extra_config: dict) -> dict:
    """SGLang's own ``get_model_loader`` for ``--load-format coldsnap`` with ``extra_config``, after loading
    the plugins through their entry point as every SGLang process does (no engine start needed to reach the
    loader's constructor): ``{"refused": message}`` for a coldsnap ``ConfigurationError``, else ``{"accepted":
    loader class name}``."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.plugins import load_plugins

    from coldsnap_core.errors import ConfigurationError

    load_plugins()
    try:
        loader = get_model_loader(LoadConfig(load_format="coldsnap", model_loader_extra_config=extra_config))
    except ConfigurationError as exc:
        return {"refused": str(exc)}
    return {"accepted": type(loader).__name__}


def main(spec_path: str, result_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ.update({k: str(v) for k, v in spec.get("env", {}).items()})
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "loader_check" in spec:
        with open(result_path, "w") as f:
            json.dump(_loader_check(spec["loader_check"]), f)
        return 0

    import sglang as sgl
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

    if spec.get("fork_schedulers"):
        _fork_schedulers()

    kwargs = {
        "model_path": spec["model"],
        "load_format": spec["load_format"],
        "dtype": spec.get("dtype", "bfloat16"),
        "device": "cpu",
        "attention_backend": "torch_native",
        # A capped KV cache: SGLang's default (mem_fraction_static 0.716) takes 13.9 GB here.
        "max_total_tokens": 2048,
        "context_length": 256,
        "mem_fraction_static": 0.1,
        "skip_server_warmup": True,
        "disable_cuda_graph": True,
        "tp_size": int(spec.get("tp_size", 1)),
        "random_seed": 0,
        "log_level": "info",
    }
    if spec.get("extra_config"):
        kwargs["model_loader_extra_config"] = json.dumps(spec["extra_config"])
    if spec.get("skip_tokenizer_init"):
        kwargs["skip_tokenizer_init"] = True
    engine = sgl.Engine(**kwargs)
    try:
        params = {"temperature": 0.0, "max_new_tokens": int(spec.get("max_tokens", 8))}
        prompts = spec.get("prompts", ["The capital of France is"])
        if spec.get("skip_tokenizer_init"):
            outputs = engine.generate(input_ids=prompts, sampling_params=params)
        else:
            outputs = engine.generate(prompt=prompts, sampling_params=params)
        result: dict[str, object] = {
            "outputs": [o["output_ids"] if spec.get("skip_tokenizer_init") else o["text"] for o in outputs],
            "output_ids": [o["output_ids"] for o in outputs],
            "checksums": [],
        }
        if spec.get("checksums", True):
            success, message, ranks, _ = engine.loop.run_until_complete(
                engine.tokenizer_manager.check_weights(CheckWeightsReqInput(action="checksum"), None)
            )
            if not success:
                raise RuntimeError(f"SGLang's weights checker failed: {message}")
            result["checksums"] = [
                rank["checksums"] for rank in sorted(ranks or [], key=lambda r: r["parallelism_info"][0]["tp_rank"])
            ]
    finally:
        engine.shutdown()
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":  # SGLang spawns its scheduler processes, which re-import this file
    sys.exit(main(sys.argv[1], sys.argv[2]))
