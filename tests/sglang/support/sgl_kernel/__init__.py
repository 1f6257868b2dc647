"""Test support: a pure-Python stand-in for the ``sgl_kernel`` names SGLang's CPU engine imports.

Never shipped (it lives under ``tests/``). SGLang 0.5.23 with ``SGLANG_USE_CPU_ENGINE=1`` imports these
names from ``sgl_kernel`` at module level, but the only ``sgl_kernel`` on PyPI (``sglang-kernel`` 0.4.10) is
a CUDA build that fails to import without ``libcuda.so.1``, and SGLang's CPU kernel build is not published
there. The tests and the SGLang demo put this folder's parent first on ``PYTHONPATH`` (which reaches SGLang's
spawned scheduler processes). ``cpu_has_amx_support()`` in ``sglang/srt/utils/common.py`` also checks
``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")``, which stays false here, so every layer takes its
``forward_native`` path and attention runs on ``torch_native``.

Of these names, a greedy generation with ``torch_native`` attention calls only
``assign_req_to_token_pool_cpu`` (``sglang/srt/mem_cache/common.py``); the others belong to speculative
decoding and KV cache moves and raise ``NotImplementedError`` so that a use is loud, never silently wrong.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+coldsnap-cpu-stand-in"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    context_length: int | None = None,
) -> None:
    """For each request ``i``: ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` takes the
    next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` (int32/int64 index tensors, 1-D,
    ``req_to_token`` 2-D [pool size, context length]). SGLang passes ``req_to_token.shape[1]`` as the sixth
    argument (``sglang/srt/mem_cache/allocation.py``, ``assign_req_to_token_pool_func``); it is not needed here."""
    position = 0
    for i in range(len(req_pool_indices)):
        start, end = int(start_offset[i]), int(end_offset[i])
        length = end - start
        req_to_token[int(req_pool_indices[i]), start:end] = out_cache_loc[position : position + length].to(req_to_token.dtype)
        position += length


def _not_available(name: str):
    def stand_in(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"sgl_kernel.{name} is not available in coldsnap's CPU test stand-in")

    stand_in.__name__ = name
    return stand_in


copy_all_layer_kv_cache_cpu = _not_available("copy_all_layer_kv_cache_cpu")
verify_tree_greedy_cpu = _not_available("verify_tree_greedy_cpu")
fill_bonus_tokens_cpu = _not_available("fill_bonus_tokens_cpu")
fill_accept_out_cache_loc_cpu = _not_available("fill_accept_out_cache_loc_cpu")
build_tree_kernel_efficient_cpu = _not_available("build_tree_kernel_efficient_cpu")
assign_extend_cache_locs_cpu = _not_available("assign_extend_cache_locs_cpu")
assign_draft_cache_locs_contiguous_cpu = _not_available("assign_draft_cache_locs_contiguous_cpu")
