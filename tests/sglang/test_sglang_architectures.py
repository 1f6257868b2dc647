"""Another architecture than llama through the real SGLang engine (sglang 0.5.23 on the CPU): GPT-2.

GPT-2 (a tiny random checkpoint built at test time, ``tests/support/tiny_checkpoints.py``; no tokenizer:
``skip_tokenizer_init`` and token-id prompts) is the one of the three architectures of
``tests/vllm/test_vllm_architectures.py`` chosen here: SGLang's CPU path loads it with the ``sgl_kernel``
stand-in of this machine (``tests/sglang/support``), and ``sglang/srt/models/gpt2.py`` loads every ``Conv1D``
weight through ``loaded_weight.t()`` as vLLM does, so both engines copy transposed views row by row. Of the
other two, the Mixtral checkpoint also loads here (and generates vLLM's greedy tokens); the GPTQ llama does
not: SGLang's CPU GPTQ post-processing calls an operator the stand-in lacks (``AttributeError: '_OpNamespace'
'sgl_kernel' object has no attribute 'convert_weight_packed_scale_zp'``, ``sglang/srt/layers/amx_utils.py``
from ``sglang/srt/hardware_backend/cpu/quantization/gptq_kernels.py``), and no PyPI wheel ships SGLang's CPU
kernels.

One fixture of module scope: a plain SGLang load, an SGLang capture, an SGLang native restore in a fresh
engine; vLLM's capture of the same checkpoint folder is the session's (``vllm_gpt2``), so the two engines'
packs are compared byte for byte in the same run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sglang_support import coldsnap_env, run_sglang, sglang_python

from coldsnap_core.artifact.capsules import read_capsule, read_descriptor
from coldsnap_core.format.safetensors_header import read_header

pytestmark = [pytest.mark.engine, pytest.mark.sglang]

PROMPTS = [[1, 5, 9, 33, 70], [7, 7, 100, 3]]  # the vLLM runs' TOKEN_PROMPTS (tests/vllm/engine_support.py)
WORKER = "worker-0-of-1"


def _only_pack(state: Path) -> Path:
    (pack,) = sorted((state / "model-payloads" / "sha256").glob("*.pack"))
    return pack


@pytest.fixture(scope="module")
def gpt2(vllm_gpt2: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """SGLang's plain load, capture and native restore of the session's GPT-2 checkpoint, and vLLM's capture
    of that folder (the session's, ``vllm_gpt2`` in ``tests/conftest.py``)."""
    sglang_python()  # skip before any work without the SGLang virtual environment
    work = tmp_path_factory.mktemp("sglang-gpt2")
    model = vllm_gpt2["model"]
    runs = {"work": work, "model": model, "artifact": work / "artifact", "state": work / "state"}
    common = {"skip_tokenizer_init": True, "prompts": PROMPTS}
    env = coldsnap_env(runs["artifact"], runs["state"])
    runs["plain"] = run_sglang(work, "plain", model, "safetensors", **common)
    runs["capture"] = run_sglang(work, "capture", model, "coldsnap", env={**env, "COLDSNAP_EXPORT_MODEL_PAYLOAD": "1"}, **common)
    runs["restore"] = run_sglang(work, "restore", model, "coldsnap", env={**env, "COLDSNAP_RESTORE": "native"}, **common)
    runs["vllm-artifact"], runs["vllm-state"] = vllm_gpt2["artifact"], vllm_gpt2["state"]
    runs["vllm-capture"] = vllm_gpt2["capture"]
    return runs


def _assert_same_load(result, plain) -> None:
    assert result.started, result.log[-5000:]
    assert plain.started, plain.log[-5000:]
    assert len(plain.checksums[0]) == 28
    different = sorted(n for n in plain.checksums[0] if result.checksums[0].get(n) != plain.checksums[0][n])
    assert set(result.checksums[0]) == set(plain.checksums[0]) and different == [], different
    assert result.output_ids == plain.output_ids and [len(o) for o in plain.output_ids] == [8, 8]


def test_gpt2_capture_then_restore_equals_a_plain_sglang_load(gpt2: dict) -> None:
    """GPT-2 in SGLang: the capture run (the observed load) and a native restore in a fresh engine hold the
    bytes of a plain SGLang load in every parameter (SGLang's weights checker) and generate the same greedy
    token ids; the capsule holds every checkpoint byte as model bytes, the transposed ``Conv1D`` weights
    included, and the restore read no checkpoint. Fails if SGLang's capture classifies the copies from the
    transposed views as residual, or if the restore hydrates other bytes or falls back."""
    plain, capture, restore = gpt2["plain"], gpt2["capture"], gpt2["restore"]
    _assert_same_load(capture, plain)
    _assert_same_load(restore, plain)
    assert [line for line in restore.coldsnap_lines() if f"restored {WORKER} from pack" in line]
    assert [line for line in restore.coldsnap_lines() if "could not restore" in line] == []
    header = read_header(gpt2["model"] / "model.safetensors")
    native = read_capsule(gpt2["artifact"] / "workers" / WORKER).native
    assert native.model_bytes == sum(t.size_bytes for t in header.values())
    assert {e.provenance.tensor_name for e in native.model_extents} == set(header)
    assert native.capture_point == "portable"


def test_gpt2_sglang_and_vllm_captures_name_the_same_pack(gpt2: dict) -> None:
    """The model bytes of the GPT-2 checkpoint are the same in both engines (each copies the transposed
    ``Conv1D`` weights row by row), so vLLM's capture of the same folder names SGLang's pack digest, with a
    byte-identical pack file, while each engine keeps its own capsule. Fails if either engine's capture
    splits, orders or classifies the transposed or fused copies differently (the packs then differ)."""
    vllm = gpt2["vllm-capture"]
    assert vllm.error is None, vllm.error
    sglang_pack = read_descriptor(gpt2["artifact"]).workers[0].payload
    vllm_pack = read_descriptor(gpt2["vllm-artifact"]).workers[0].payload
    assert sglang_pack == vllm_pack and vllm.outcome["pack"] == sglang_pack.sha256
    assert _only_pack(gpt2["state"]).read_bytes() == _only_pack(gpt2["vllm-state"]).read_bytes()
    sglang_native = read_capsule(gpt2["artifact"] / "workers" / WORKER).native
    vllm_native = read_capsule(gpt2["vllm-artifact"] / "workers" / WORKER).native
    assert sglang_native.layout_fingerprint != vllm_native.layout_fingerprint
