"""Attention over a paged KV cache.

The cache of one layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]. A step's
tokens are laid out decodes first, then prefill chunks (one causal call each, offset by the tokens
already cached). Decodes come in groups of similar context length, each attended in one batched
call over its gathered blocks: every row is padded to its group's longest context, and grouping
by length halves that padding at large batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from devharness.model import kernels


@dataclass
class PrefillChunk:
    token_start: int        # index of the chunk's first token in the step's flattened batch
    num_tokens: int
    context_len: int        # tokens cached before this chunk + the chunk itself
    block_ids: torch.Tensor  # the request's blocks covering context_len


@dataclass
class DecodeGroup:
    token_start: int
    block_tables: torch.Tensor    # [num_decodes, max_blocks], padded with block 0 (masked out)
    context_lens: torch.Tensor    # [num_decodes]


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one attends to."""

    slot_mapping: torch.Tensor            # [num_tokens]: block_id * block_size + offset
    num_decode_tokens: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]


class PagedAttention(nn.Module):
    """Writes this step's K/V into the cache, then attends; holds the layer's cache tensors."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]. Returns [T, Hq * D]."""
        # Write before reading: a chunk attends to its own keys through the cache.
        kernels.write_kv(self.k_cache, self.v_cache, meta.slot_mapping, k, v)
        groups = meta.decode_groups
        if not meta.prefills and len(groups) == 1 and groups[0].context_lens.shape[0] == q.shape[0]:
            return self._decode(q, groups[0]).reshape(q.shape[0], -1)   # one call for every token
        out = torch.empty_like(q)
        for group in groups:
            s, n = group.token_start, group.context_lens.shape[0]
            out[s:s + n] = self._decode(q[s:s + n], group)
        for chunk in meta.prefills:
            s, n = chunk.token_start, chunk.num_tokens
            out[s:s + n] = self._prefill(q[s:s + n], k[s:s + n], v[s:s + n], chunk)
        return out.reshape(q.shape[0], -1)

    def _decode(self, q, group: DecodeGroup):
        # kernels.decode: eager gathers whole blocks and calls SDPA; compiled reads the cache in place.
        return kernels.decode(q, self.k_cache, self.v_cache, group.block_tables, group.context_lens, self.scale)

    def _prefill(self, q, k, v, chunk: PrefillChunk):
        # SDPA gets [1, heads, tokens, head_dim]: with a batch dimension torch's CPU SDPA runs its flash kernel;
        # without one (3-D) it took its plain path, 2-6x slower for prompts of 64-1024 tokens.
        n, ctx = chunk.num_tokens, chunk.context_len
        if ctx == n:  # nothing cached before this chunk: its own keys, plain causal
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], is_causal=True, scale=self.scale,
                                               enable_gqa=True)
            return o[0].transpose(0, 1)
        keys = self.k_cache.index_select(0, chunk.block_ids).view(-1, self.num_kv_heads, self.head_dim)[:ctx]
        vals = self.v_cache.index_select(0, chunk.block_ids).view(-1, self.num_kv_heads, self.head_dim)[:ctx]
        q_pos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= q_pos
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                           vals.transpose(0, 1)[None], attn_mask=mask, scale=self.scale,
                                           enable_gqa=True)
        return o[0].transpose(0, 1)
