"""The tiny checkpoints of ``tests/support/tiny_checkpoints.py`` that the architecture engine tests load:
the same bytes on every build, and a GPTQ layout that vLLM's own unpacking reads back as the quantized
weights. No engine starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.tiny_checkpoints import (
    GPTQ_GROUP_SIZE,
    GPTQ_PROJECTIONS,
    build_tiny_gpt2,
    build_tiny_gptq_llama,
    build_tiny_mixtral,
    gptq_llama_before_quantization,
)


@pytest.mark.parametrize("build", [build_tiny_mixtral, build_tiny_gpt2, build_tiny_gptq_llama])
def test_each_build_writes_the_same_bytes(build, tmp_path: Path) -> None:
    """Two builds into two folders give byte-identical ``model.safetensors`` and ``config.json``: the
    checkpoints are a function of the code alone (fixed seeds), so two engines or two runs that build one
    compare the same weights. Fails if a builder draws from an unseeded generator."""
    a, b = build(tmp_path / "a"), build(tmp_path / "b")
    for name in ("model.safetensors", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.vllm
def test_gptq_tensors_are_what_vllm_unpacks_as_the_quantized_weights(tmp_path: Path) -> None:
    """The GPTQ checkpoint read the way vLLM reads it: ``AutoGPTQConfig.from_config`` accepts its
    ``quantization_config`` as 4-bit symmetric (``uint4b8``, group size 32, no activation order);
    ``unpack_quantized_values_into_int32`` (``vllm/model_executor/layers/quantization/utils/quant_utils.py``)
    unpacks every ``qweight`` along the input dimension to values whose dequantization
    ``(q - 8) * scales[g_idx]`` is within about half a quantization step of the original bf16 weight (0.55:
    the bf16 rounding of a scale may clamp a group's largest value by a little more), every
    ``qzeros`` nibble is 7 and ``g_idx`` is ``i // 32``. Fails if the nibbles are packed in another order or
    along the other dimension (the engine would then serve other weights than the ones quantized)."""
    import torch
    from safetensors.torch import load_file
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    folder = build_tiny_gptq_llama(tmp_path / "gptq")
    config = AutoGPTQConfig.from_config(json.loads((folder / "config.json").read_text())["quantization_config"])
    assert (config.quant_type, config.group_size, config.desc_act) == (scalar_types.uint4b8, GPTQ_GROUP_SIZE, False)
    tensors = load_file(str(folder / "model.safetensors"))
    original = gptq_llama_before_quantization().state_dict()
    checked = 0
    for name, weight in original.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in GPTQ_PROJECTIONS:
            assert torch.equal(tensors[name], weight), name
            continue
        q = unpack_quantized_values_into_int32(tensors[f"{module}.qweight"], scalar_types.uint4b8, 0)
        zeros = unpack_quantized_values_into_int32(tensors[f"{module}.qzeros"], scalar_types.uint4b8, 1)
        g_idx, scales = tensors[f"{module}.g_idx"], tensors[f"{module}.scales"].float()
        assert q.shape == weight.t().shape and int(q.min()) >= 0 and int(q.max()) <= 15
        assert torch.equal(zeros, torch.full_like(zeros, 7))
        assert torch.equal(g_idx, torch.arange(weight.shape[1], dtype=torch.int32) // GPTQ_GROUP_SIZE)
        dequantized = (q.float() - 8) * scales[g_idx.long()]
        error = (dequantized - weight.float().t()).abs()
        assert bool((error <= 0.55 * scales[g_idx.long()]).all()), module
        checked += 1
    assert checked == 2 * len(GPTQ_PROJECTIONS)
