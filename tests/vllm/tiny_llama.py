"""A tiny Llama checkpoint generated locally, for tensor parallel mechanics only.

SmolLM2 has 9 attention heads and 3 KV heads, so vLLM refuses tensor parallel size 2 for it
("Total number of attention heads (9) must be divisible by tensor parallel size (2)",
``vllm/config/model.py``). This model has 4 heads and 2 KV heads of size 32 (a head size the
CPU attention backend supports, ``vllm/v1/attention/backends/cpu_attn.py``), random weights from a fixed seed, no
tokenizer (engines run with ``skip_tokenizer_init`` and token-id prompts). Its weights are not
trained: it exercises sharding, not language.
"""

from __future__ import annotations

from pathlib import Path


def build_tiny_llama(folder: Path) -> Path:
    """Write the checkpoint (``config.json``, ``model.safetensors``, bf16) into ``folder`` once."""
    if (folder / "model.safetensors").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
