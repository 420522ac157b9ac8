"""Attention over a paged KV cache.

The cache of one layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]. A step's
tokens are laid out decodes first, then prefill chunks (one causal call each, offset by the tokens
already cached). Decodes come in groups of similar context length, each attended in one batched
call over its gathered blocks: every row is padded to its group's longest context, and grouping
by length halves that padding at large batch (the runner sizes the groups as its kernels ask: the
fast decode kernel reads each row to its own length, so all of a step's decodes go in one call). A step of
decodes alone in one group, where the kernels fuse it, runs RoPE, the cache write and the attention as one op
(decode_attention: forward_decodes); every other step, and every step while something wraps one of those ops,
the ops one by one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


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

    ops = None   # the kernels handed to the model (DecoderForCausalLM.set_kernels)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]. Returns [T, Hq * D]."""
        # Write before reading: a chunk attends to its own keys through the cache.
        self.ops.write_kv(self.k_cache, self.v_cache, meta.slot_mapping, k, v)
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

    def fuses_rotary(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether this step's RoPE, cache write and attention run as one op (decode_attention, forward_decodes):
        every token is a decode, in one group, and the kernels fuse it (Kernels.fuses: not while a fault or a
        capture wraps one of its parts)."""
        groups = meta.decode_groups
        return not meta.prefills and len(groups) == 1 and groups[0].context_lens.shape[0] == num_tokens \
            and self.ops.fuses("decode_attention")

    def forward_decodes(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """forward() of q and k rotated by cos/sin [T, 1, D], for a step fuses_rotary() takes, in one op: q, k and v
        [T, H, D] not yet rotated. Returns [T, Hq * D]."""
        group = meta.decode_groups[0]
        out = self.ops.decode_attention(q, k, v, cos, sin, self.k_cache, self.v_cache, meta.slot_mapping,
                                        group.block_tables, group.context_lens, self.scale)
        return out.view(q.shape[0], -1)

    def _decode(self, q, group: DecodeGroup):
        return self.ops.paged_decode(q, self.k_cache, self.v_cache, group.block_tables, group.context_lens,
                                     self.scale)

    def _prefill(self, q, k, v, chunk: PrefillChunk):
        return self.ops.prefill_attention(q, k, v, self.k_cache, self.v_cache, chunk.block_ids, chunk.context_len,
                                          self.scale)
