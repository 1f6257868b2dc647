"""``vllm serve MODEL --load-format coldsnap`` restores and answers a completion (the CLI path).

This is the one test that goes through vLLM's own process layout: the API server, the engine core
process and the worker process each load the ``vllm.general_plugins`` entry point
(``coldsnap_vllm:register``), so it fails if the plugin is not installed as an entry point or does
not register in every process. The artifact comes from a capture in another process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_support import coldsnap_env, run_engine, serve_completion

pytestmark = [pytest.mark.engine, pytest.mark.vllm]


def test_vllm_serve_restores_and_answers(smollm2_2layer: Path, tmp_path: Path) -> None:
    """Capture in one process, then ``vllm serve --load-format coldsnap`` with ``COLDSNAP_RESTORE=native``:
    the worker restores from pack + residual (its log says so, with no fallback WARNING) and
    ``/v1/completions`` returns the same greedy text as the captured engine."""
    prompt = "The capital of France is"
    env = coldsnap_env(tmp_path / "artifact", tmp_path / "state")
    captured = run_engine(
        tmp_path, "capture", smollm2_2layer, "coldsnap", env={**env, "COLDSNAP_EXPORT_MODEL_PAYLOAD": "1"}, prompts=[prompt]
    )
    assert captured.error is None and captured.outcome["kind"] == "captured"

    text, log_text = serve_completion(smollm2_2layer, tmp_path, "serve", {**env, "COLDSNAP_RESTORE": "native"}, prompt=prompt)
    assert text == captured.outputs[0]
    assert "coldsnap: restored worker-0-of-1 from pack" in log_text
    assert "could not restore" not in log_text
