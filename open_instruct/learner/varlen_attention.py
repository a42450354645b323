"""Attention over a packed row sequence by sequence (varlen), with torch's SDPA, where flash-attention's varlen kernel
is not installed (CPUs, GPUs without flash-attn).

A packed micro-batch (rl/packing.py, --max_tokens_per_micro_batch T) lays several sequences end to end in one row. Told
the sequence starts only through restarting position ids, transformers' SDPA attention builds a block-diagonal causal
mask over the whole row and computes every query against every key of the row, T^2 scores, most of them masked: at
T = 4096 on SmolLM2-135M that is more FLOPs than all the linear layers together (30 layers x 4096^2 pairs x 2 x 2 x
576 = 1.16 TFLOP a forward against 0.87 for the weights), and measured on a 2-core Xeon it ate the whole saving of
packing (docs/speed.md). Here the packed forward passes the sequences' cumulative lengths (`cu_seq_lens_q/k`, the
kwargs flash-attention's varlen path takes) and this attention runs causal SDPA on each sequence alone: sum(L_i^2)/2
scores instead of T^2. Every other forward (padded rows, a 2D attention mask) goes to transformers' own SDPA, unchanged.
"""

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "open_instruct_varlen_sdpa"


def varlen_sdpa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                          dropout: float = 0.0, scaling: float | None = None, cu_seq_lens_q=None, **kwargs):  # fmt: skip
    """query [1, heads, T, dim], key and value [1, kv_heads, T, dim] of one packed row with `cu_seq_lens_q` (its
    sequences' cumulative lengths [0, L_1, L_1 + L_2, ..., T]): each sequence's causal attention alone. Returns
    [1, T, heads, dim], as transformers' attention functions do. Anything else: transformers' SDPA."""
    if cu_seq_lens_q is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    bounds = cu_seq_lens_q.tolist()
    outputs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
            dropout_p=dropout, is_causal=True, scale=scaling,
        )
        for start, end in zip(bounds[:-1], bounds[1:])
    ]  # fmt: skip
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, varlen_sdpa_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # padded rows get the mask SDPA would


def use_varlen_attention(model) -> None:
    """Packed forwards of `model` attend sequence by sequence, unless it already uses flash-attention (whose varlen
    kernel takes the same cumulative lengths) or an attention of its own that is not SDPA."""
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(NAME)
