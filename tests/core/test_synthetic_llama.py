"""tools/synthetic_llama.py: the benchmark checkpoint generator writes valid, sharded, deterministic safetensors."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from synthetic_llama import PRESETS, header_bytes, plan_shards, write_checkpoint

from coldsnap_core.format.safetensors_header import read_header

GOLDEN_TINY = {
    "model-00001-of-00004.safetensors": "cc5054ea0d85d161f408bb3a88ece831d266db8bf9ac3c31159864eddc56a1c9",
    "model-00002-of-00004.safetensors": "5a451b23f754cb427e2acaf81358ad7ff1c7a7d72c17d1906b019af60bf28ed2",
    "model-00003-of-00004.safetensors": "aa06d5aff69a84e4d0a4b84c241869c1ba6b6d523a0d020d40373c1ee42fb192",
    "model-00004-of-00004.safetensors": "e86fbb92c94da4f436f14ac843393c642f888081fca530157abb5453d702f75c",
}


def test_tiny_checkpoint_is_golden_and_valid(tmp_path: Path) -> None:
    """Golden SHA-256 per shard of the ``tiny`` preset in 60 kB shards: fails on any change of the
    weights, the order, the header or the sharding (benchmark figures would then not compare across
    runs). safetensors and coldsnap's own header parser read every tensor at the offsets the index
    promises; weights are finite with 2**-9 <= |x| < 2**-5, norms are 1."""
    paths = write_checkpoint(tmp_path / "bf16", PRESETS["tiny"], shard_bytes=60_000)
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths} == GOLDEN_TINY
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    names = [name for name, _ in PRESETS["tiny"].tensors()]
    assert sorted(index["weight_map"]) == sorted(names)
    total = 0
    for path in paths:
        header = read_header(path)
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                assert index["weight_map"][name] == path.name
                t = f.get_tensor(name).float().numpy()
                assert header[name].size_bytes == t.size * 2
                total += t.size * 2
                if name.endswith("norm.weight"):
                    assert (t == 1).all()
                else:
                    assert np.isfinite(t).all() and (np.abs(t) >= 2**-9).all() and (np.abs(t) < 2**-5).all()
    assert total == index["metadata"]["total_size"] == PRESETS["tiny"].parameters() * 2


def test_float32_is_the_bf16_values_widened(tmp_path: Path) -> None:
    """``--dtype float32`` holds exactly the bf16 checkpoint's values (so a converting load of it to
    bf16 gives the bf16 checkpoint's bytes); fails if the two dtypes drift apart."""
    import torch

    bf16 = write_checkpoint(tmp_path / "a", PRESETS["tiny"])
    fp32 = write_checkpoint(tmp_path / "b", PRESETS["tiny"], dtype="float32")
    with safe_open(bf16[0], "pt") as a, safe_open(fp32[0], "pt") as b:
        for name in a.keys():  # noqa: SIM118
            assert b.get_tensor(name).dtype == torch.float32
            assert torch.equal(b.get_tensor(name).to(torch.bfloat16), a.get_tensor(name))


def test_the_1_7b_layout_crosses_2_gib_and_1_gib_boundaries() -> None:
    """The ``1.7b`` preset (planned, not written): 1.71 B parameters, 3.4 GB bf16 in two shards, the
    first holding data past 2**31 bytes and tensors that straddle 1 GiB file offsets: the cases a
    32-bit offset or a 1 GiB read-window bug breaks. Fails if the sharding stops covering them."""
    shape = PRESETS["1.7b"]
    assert 1.70e9 < shape.parameters() < 1.72e9
    shards = plan_shards(shape, "bfloat16", 2_500_000_000)
    assert len(shards) == 2
    first = shards[0]
    data_start = len(header_bytes(first, "bfloat16"))
    ends = [data_start + t.begin_bytes + t.size_bytes for t in first]
    assert max(ends) > 2**31
    straddles = [
        t for t in first if (data_start + t.begin_bytes) // 2**30 != (data_start + t.begin_bytes + t.size_bytes - 1) // 2**30
    ]
    assert len(straddles) >= 2


def test_refuses_a_folder_with_a_checkpoint(tmp_path: Path) -> None:
    """Writing over an existing checkpoint is refused (mixed shards would be a silent wrong model)."""
    write_checkpoint(tmp_path, PRESETS["tiny"])
    with pytest.raises(FileExistsError, match="already holds safetensors files"):
        write_checkpoint(tmp_path, PRESETS["tiny"])
