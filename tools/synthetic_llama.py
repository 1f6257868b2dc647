#!/usr/bin/env python3
"""Write a synthetic llama checkpoint of any shape: sharded safetensors with an index, deterministic weights.

For benchmarks at scale (``benchmarks/vllm_load.py --checkpoint``, ``benchmarks/capture.py
--checkpoint``, ``benchmarks/gpu_wake.py --synthetic``): a ``LlamaForCausalLM`` folder that vLLM
loads like a downloaded model (``config.json``, ``generation_config.json``,
``model-0000k-of-0000n.safetensors``, ``model.safetensors.index.json`` and, with
``--tokenizer-from``, the tokenizer files of a real model with the same vocabulary).

Layout and bytes (reproducible: the same arguments always give the same files, byte for byte):

* tensors in the order of the Hugging Face llama state dict (embedding, then per layer the attention
  projections, the MLP projections and the two norms, then the final norm, then ``lm_head`` unless
  the embeddings are tied), names and shapes as in ``transformers``' ``modeling_llama.py``;
* shards are filled in that order up to ``--shard-bytes`` (default 2.5 GB, so a 3.4 GB bf16 model
  has a first shard past 2**31 bytes and tensors that cross 1 GiB file offsets: the cases 32-bit
  offset or ``mmap`` window bugs break on); a tensor larger than the limit gets a shard of its own;
* each file is a safetensors file (8-byte little-endian header length, the JSON header, the data;
  huggingface/safetensors ``README.md``) whose header is padded with spaces to a multiple of 8 bytes
  and lists tensors in data order, written tensor by tensor (the peak memory is one tensor);
* weights: per tensor a PCG64 stream seeded by SHA-256 of ``seed/name``, mapped to bf16 values of
  magnitude 2**-9 to 2**-5 with random sign (finite, small, so the model runs; not trained); the norm
  weights are 1.0; ``--dtype float32`` writes the same values widened to fp32 (exactly).

Usage::

    python tools/synthetic_llama.py OUT --preset 1.7b [--dtype bfloat16] [--shard-bytes 2500000000]
        [--tokenizer-from /path/to/smollm2] [--layers N] [--hidden N] [--intermediate N] [--heads N]
        [--kv-heads N] [--vocab N] [--untied] [--seed 0]

Presets: ``tiny`` (2 layers of width 64, 0.2 MB: tests), ``135m`` (SmolLM2-135M's shape, 269 MB bf16), ``1gb`` (SmolLM2-1.7B's width, 6 layers,
1.0 GB), ``1.7b`` (SmolLM2-1.7B's shape, 1.71 B parameters, 3.4 GB bf16).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions of a llama model (``transformers`` ``LlamaConfig`` names in :meth:`config`)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of every tensor, in state-dict order."""
        kv = self.kv_heads * self.head_dim
        yield "model.embed_tokens.weight", (self.vocab, self.hidden)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            yield p + "self_attn.q_proj.weight", (self.hidden, self.hidden)
            yield p + "self_attn.k_proj.weight", (kv, self.hidden)
            yield p + "self_attn.v_proj.weight", (kv, self.hidden)
            yield p + "self_attn.o_proj.weight", (self.hidden, self.hidden)
            yield p + "mlp.gate_proj.weight", (self.intermediate, self.hidden)
            yield p + "mlp.up_proj.weight", (self.intermediate, self.hidden)
            yield p + "mlp.down_proj.weight", (self.hidden, self.intermediate)
            yield p + "input_layernorm.weight", (self.hidden,)
            yield p + "post_attention_layernorm.weight", (self.hidden,)
        yield "model.norm.weight", (self.hidden,)
        if not self.tied:
            yield "lm_head.weight", (self.vocab, self.hidden)

    def parameters(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.tensors())

    def config(self, dtype: str) -> dict[str, object]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 2,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate,
            "max_position_embeddings": 8192,
            "mlp_bias": False,
            "num_attention_heads": self.heads,
            "num_hidden_layers": self.layers,
            "num_key_value_heads": self.kv_heads,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 100000.0,
            "tie_word_embeddings": self.tied,
            "torch_dtype": dtype,
            "use_cache": True,
            "vocab_size": self.vocab,
        }


PRESETS: dict[str, LlamaShape] = {
    "tiny": LlamaShape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256),
    "135m": LlamaShape(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, vocab=49152),
    "1gb": LlamaShape(layers=6, hidden=2048, intermediate=8192, heads=32, kv_heads=32, vocab=49152),
    "1.7b": LlamaShape(layers=24, hidden=2048, intermediate=8192, heads=32, kv_heads=32, vocab=49152),
}
DTYPES = {"bfloat16": ("BF16", 2), "float32": ("F32", 4)}
DEFAULT_SHARD_BYTES = 2_500_000_000
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    size_bytes: int
    begin_bytes: int
    """Offset of the tensor's first byte in its shard's data section."""


def plan_shards(shape: LlamaShape, dtype: str, shard_bytes: int) -> list[list[PlannedTensor]]:
    """Tensors per shard, in state-dict order, each shard's data at most ``shard_bytes`` (a larger tensor alone)."""
    item = DTYPES[dtype][1]
    shards: list[list[PlannedTensor]] = [[]]
    used = 0
    for name, dims in shape.tensors():
        size = int(np.prod(dims)) * item
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(PlannedTensor(name, dims, size, used))
        used += size
    return shards


def header_bytes(tensors: list[PlannedTensor], dtype: str) -> bytes:
    """The safetensors header (length prefix + JSON padded with spaces to a multiple of 8)."""
    doc: dict[str, object] = {"__metadata__": {"format": "pt"}}
    for t in tensors:
        doc[t.name] = {
            "dtype": DTYPES[dtype][0],
            "shape": list(t.shape),
            "data_offsets": [t.begin_bytes, t.begin_bytes + t.size_bytes],
        }
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def tensor_values(seed: int, name: str, count: int, dtype: str) -> np.ndarray:
    """The tensor's ``count`` elements as their raw little-endian bits (uint16 for bf16, uint32 for fp32)."""
    if name.endswith("norm.weight"):
        bits = np.full(count, 0x3F80, dtype=np.uint16)  # 1.0
    else:
        key = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:16], "little")
        r = np.random.Generator(np.random.PCG64(key)).integers(0, 1 << 16, count, dtype=np.uint16)
        # bf16 = sign | 8 exponent bits | 7 mantissa bits; exponent 0x76..0x79: 2**-9 <= |x| < 2**-5.
        bits = (r & np.uint16(0x807F)) | ((np.uint16(0x76) + ((r >> np.uint16(7)) & np.uint16(3))) << np.uint16(7))
    if dtype == "float32":
        return bits.astype(np.uint32) << np.uint32(16)  # bf16 widened to fp32: the same value, exactly
    return bits


def write_checkpoint(
    out: Path,
    shape: LlamaShape,
    *,
    dtype: str = "bfloat16",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    seed: int = 0,
    tokenizer_from: Path | None = None,
    chunk_elements: int = 16 << 20,
) -> list[Path]:
    """Write the checkpoint folder ``out`` (created; must not hold safetensors files) and return the shard paths.

    Raises:
        FileExistsError: ``out`` already holds ``*.safetensors`` files.
        ValueError: an unknown dtype or a non-positive ``shard_bytes``.
    """
    if dtype not in DTYPES or shard_bytes <= 0:
        raise ValueError(f"dtype {dtype!r} (one of {sorted(DTYPES)}) or shard_bytes {shard_bytes} is invalid")
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")):
        raise FileExistsError(f"{out} already holds safetensors files")
    shards = plan_shards(shape, dtype, shard_bytes)
    paths = []
    weight_map: dict[str, str] = {}
    total = 0
    for k, tensors in enumerate(shards, start=1):
        path = out / f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        partial = path.with_name(path.name + ".partial")
        with open(partial, "wb") as f:
            f.write(header_bytes(tensors, dtype))
            for t in tensors:
                count = t.size_bytes // DTYPES[dtype][1]
                values = tensor_values(seed, t.name, count, dtype)
                for start in range(0, count, chunk_elements):
                    f.write(values[start : start + chunk_elements].tobytes())
                weight_map[t.name] = path.name
                total += t.size_bytes
            f.flush()
            os.fsync(f.fileno())
        partial.rename(path)
        paths.append(path)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(shape.config(dtype), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2) + "\n")
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_from / name).is_file():
                shutil.copyfile(tokenizer_from / name, out / name)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1.7b")
    for flag in ("layers", "hidden", "intermediate", "heads", "kv-heads", "vocab"):
        parser.add_argument(f"--{flag}", type=int, default=None, help="override the preset")
    parser.add_argument("--untied", action="store_true", help="a separate lm_head (default: tied to the embedding)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-from", type=Path, default=None, help="copy tokenizer files from this model folder")
    args = parser.parse_args(argv)
    shape = PRESETS[args.preset]
    overrides = {
        field: getattr(args, field.replace("-", "_"))
        for field in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")
        if getattr(args, field) is not None
    }
    shape = replace(shape, **overrides, tied=not args.untied)
    item = DTYPES[args.dtype][1]
    print(f"synthetic_llama: {shape} -> {shape.parameters() / 1e9:.3f} B parameters, {shape.parameters() * item / 1e9:.2f} GB")
    paths = write_checkpoint(
        args.out, shape, dtype=args.dtype, shard_bytes=args.shard_bytes, seed=args.seed, tokenizer_from=args.tokenizer_from
    )
    for path in paths:
        print(f"synthetic_llama: wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
