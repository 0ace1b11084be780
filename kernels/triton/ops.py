"""The triton path's entry points, as the engine calls them (through `kernels.dispatch`)."""

from __future__ import annotations

import torch

from kernels.attention import PagedMetadata
from kernels.triton.decode_attention import decode_attention
from kernels.triton.kv_write import write_kv
from kernels.triton.lora_shrink_expand import (
    LoRABatch,
    SlotLayout,
    add_lora,
    lora_batch,
    slot_layouts,
)
from kernels.triton.prefill_attention import prefill_attention
from kernels.triton.rms_norm import add_rms_norm, rms_norm
from kernels.triton.rotary import rotary_

__all__ = [
    "LoRABatch",
    "SlotLayout",
    "add_lora",
    "add_rms_norm",
    "lora_batch",
    "paged_attention",
    "rms_norm",
    "rotary_",
    "slot_layouts",
    "write_kv",
]


def paged_attention(
    query: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: PagedMetadata,
    scale: float,
) -> torch.Tensor:
    """`kernels.attention.paged_attention` for a plan built by `build_triton_plan`: decode
    rows (the first `meta.num_decode` tokens, one each) by the split-K kernel, the rest by the
    prefill kernel, both reading every key from the cache (write_kv first)."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if meta.num_decode:
        decode_attention(query, kv_cache, meta, scale, out)
    if meta.num_rows > meta.num_decode:
        prefill_attention(query, kv_cache, meta, scale, out)
    return out
