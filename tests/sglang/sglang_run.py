"""Run one real SGLang engine (sglang 0.5.23 on the CPU) in this process and write what it did as JSON.

Run with the SGLang virtual environment's Python (``scripts/setup-sglang-venv.sh``), never inside pytest:
a scheduler that fails kills the process that created the ``sgl.Engine`` (SGLang's SIGQUIT handler calls
``kill_process_tree(include_parent=True)``, ``sglang/srt/entrypoints/engine.py``), so the caller reads this
process's log and exit status instead. ``tests/sglang/support`` must be first on ``PYTHONPATH`` (the
``sgl_kernel`` stand-in) and ``SGLANG_USE_CPU_ENGINE=1`` set (``sglang/srt/utils/common.py`` ``is_cpu()``).

Usage: ``python tests/sglang/sglang_run.py SPEC.json RESULT.json`` where SPEC has ``model``, ``load_format``
(``coldsnap``, ``safetensors``, ...) and optionally ``dtype`` (``bfloat16``), ``env`` (set before SGLang is
imported), ``extra_config`` (``--model-loader-extra-config``), ``prompts``, ``max_tokens`` (8), ``tp_size``
(1), ``skip_tokenizer_init`` (prompts are then lists of token ids) and ``checksums`` (true). RESULT gets
``outputs`` (the greedy texts, or token ids without a tokenizer), ``output_ids`` (token ids) and ``checksums``
(SGLang's own weights checker, ``action=checksum``: for every parameter and persistent buffer the first 8
bytes of the SHA-256 of its bytes, ``sglang/srt/utils/weight_checker.py``; one dict per tensor parallel rank).
"""

from __future__ import annotations

import json
import os
import sys


def main(spec_path: str, result_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ.update({k: str(v) for k, v in spec.get("env", {}).items()})
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import sglang as sgl
    from sglang.srt.managers.io_struct import CheckWeightsReqInput

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
