"""The reference kernels: each op of the registry in plain torch (aten, SDPA), the form every other backend is
checked against and the one `--kernels reference` runs. Plain functions of tensors: no module state, no hooks,
no collectives, so a breakpoint here stops in Python whichever layer calls it."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N])."""
    return F.linear(x, weight, bias)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I], gate first."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu_and_mul(linear(x, weight, bias)) for a gate/up projection weight [2I, K], gate rows first."""
    return silu_and_mul(linear(x, weight, bias))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value of x [N, V], the first of equal ones, a NaN above every number:
    x.max(dim=-1).indices (argmax's index, 2.4x faster than argmax on the CPU)."""
    return x.max(dim=-1).indices


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, num_valid: int) -> torch.Tensor:
    """argmax(linear(x, weight)[:, :num_valid]): greedy tokens from the LM head."""
    return argmax(linear(x, weight)[:, :num_valid])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: aten's fused kernel in float32, the reference's formula otherwise."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream's add, then the next norm."""
    x = x + residual
    return rms_norm(x, weight, eps), x


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, H, D] by cos/sin [T, 1, D] (already gathered for the positions)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Rows of k and v [T, Hkv, D] into the paged caches [num_blocks, block_size, Hkv, D] at slot_mapping [T]
    (block * block_size + offset)."""
    hkv, d = k_cache.shape[2:]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row over its cached keys: q [B, Hq, D], caches [num_blocks, block_size, Hkv, D],
    block_tables [B, max_blocks] (padding masked by context_lens [B]). Returns [B, Hq, D]: the rows' whole
    blocks gathered (index_select), then SDPA."""
    b, nb = block_tables.shape
    _, bs, hkv, d = k_cache.shape
    flat = block_tables.flatten()
    keys = k_cache.index_select(0, flat).view(b, nb * bs, hkv, d).transpose(1, 2)
    vals = v_cache.index_select(0, flat).view(b, nb * bs, hkv, d).transpose(1, 2)
    mask = torch.arange(nb * bs, device=q.device).unsqueeze(0) < context_lens.unsqueeze(1)
    # Past a row's context (and in its table's padding blocks, which hold other requests' rows) the mask gives a
    # weight of 0, but 0 * NaN is NaN: zero those rows, so that nothing outside a row's context reaches it.
    keep = mask[:, None, :, None]
    keys, vals = keys.masked_fill(~keep, 0), vals.masked_fill(~keep, 0)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, vals, attn_mask=mask[:, None, None, :],
                                       scale=scale, enable_gqa=True)
    return o.squeeze(2)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """A step of decodes (one token a row) in one op: q [B, Hq, D] and k [B, Hkv, D] rotated by cos/sin [B, 1, D]
    (rotate), the rotated keys and v [B, Hkv, D] written to the caches at slot_mapping [B] (write_kv), then the
    rotated queries attend over the cache (paged_decode, block_tables [B, max_blocks], context_lens [B]).
    Returns [B, Hq, D]."""
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    write_kv(k_cache, v_cache, slot_mapping, k, v)
    return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, block_ids: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """A prompt chunk's causal attention: q [n, Hq, D] at the last n of context_len positions, over its own k, v
    [n, Hkv, D] when nothing was cached before it, else over the cache's first context_len rows of its blocks
    `block_ids` (the chunk's own keys already written there). Returns [n, Hq, D]."""
    # SDPA gets [1, heads, tokens, head_dim]: with a batch dimension torch's CPU SDPA runs its flash kernel;
    # without one (3-D) it took its plain path, 2-6x slower for prompts of 64-1024 tokens. A mask in every case:
    # with is_causal instead, the flash kernel gives a query holding a NaN a row of zeros (the masked call, and
    # the math of attention, a row of NaN), so a first chunk hid a NaN that a later chunk carries.
    n = q.shape[0]
    if context_len == n:   # nothing cached before this chunk: its own keys
        keys, vals = k, v
    else:
        hkv, d = k_cache.shape[2:]
        keys = k_cache.index_select(0, block_ids).view(-1, hkv, d)[:context_len]
        vals = v_cache.index_select(0, block_ids).view(-1, hkv, d)[:context_len]
    q_pos = torch.arange(context_len - n, context_len, device=q.device).unsqueeze(1)
    mask = torch.arange(context_len, device=q.device).unsqueeze(0) <= q_pos
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                       vals.transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


# -- GGUF's quantized blocks (ggml's layouts, as gguf.quants reads them): a weight [N, K] kept as its rows of
# -- blocks, a uint8 tensor [N, K / 32 * block bytes]; `qtype` is the ggml type id (gguf.GGMLQuantizationType).
Q4_1, Q8_0 = 3, 8
BLOCK_WEIGHTS = 32
# ggml type -> bytes a block of 32 weights takes: Q8_0 an fp16 scale d and 32 int8 (d * q); Q4_1 fp16 d, fp16 m
# and 16 bytes of nibbles, the low nibbles the first 16 weights, the high ones the last 16 (d * q + m).
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}


def dequantize(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """float32 [N, K] of the blocks [N, K / 32 * bytes]: gguf.quants.dequantize's values, bit for bit."""
    size = BLOCK_BYTES.get(qtype)
    if size is None:
        raise ValueError(f"ggml type {qtype} is not a quantized type devharness computes with (Q4_1, Q8_0)")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % size:
        raise ValueError(f"quantized weight {tuple(blocks.shape)} {blocks.dtype}: not uint8 rows of whole "
                         f"{size}-byte blocks")
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, size)
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    if qtype == Q8_0:
        return (b[..., 2:].contiguous().view(torch.int8).float() * d).reshape(n, -1)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    qs = b[..., 4:]
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()
    return (d * q + m).reshape(n, -1)


def q_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear(x, dequantize(blocks, qtype), bias): a projection whose weight stays in GGUF's blocks."""
    return F.linear(x, dequantize(blocks, qtype).to(x.dtype), bias)


def q_gated_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """gated_linear with the gate/up weight [2I, K] in blocks (gate rows first)."""
    return silu_and_mul(q_linear(x, blocks, qtype, bias))


def q_linear_argmax(x: torch.Tensor, blocks: torch.Tensor, qtype: int, num_valid: int) -> torch.Tensor:
    """linear_argmax with the LM head's weight in blocks."""
    return argmax(q_linear(x, blocks, qtype)[:, :num_valid])


def q_embedding(ids: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """The rows `ids` of the embedding kept in blocks [V, H / 32 * bytes]: F.embedding of its dequantized rows
    (a row's values depend on its own blocks alone, so only the looked-up rows are dequantized)."""
    rows = blocks.index_select(0, ids.reshape(-1))
    return dequantize(rows, qtype).reshape(*ids.shape, -1)
