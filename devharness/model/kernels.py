"""The forward's hook-free tensor kernels: the linear layers' products, RMSNorm (aten's fused one in float32),
RoPE's rotation, SiLU-and-mul, the KV cache write and the paged decode attention; eager, native or compiled.

Each kernel is a plain function of tensors: no module state, no hook sites, no collectives, so the
hooks in hooks.py fire in the Python frames around them whichever runs. `use(mode)` picks the kernels of a
forward: "eager" (torch's ops), "native" (C kernels built on first use, native.py: the decode attention,
the linear layers over packed weights, the norms, RoPE, SiLU-and-mul and greedy sampling's argmax; the default outside
debug mode) or "compiled" (inductor's fusion of the block gather into the decode attention's loops,
--compile; the rest eager). The native and compiled attentions read the cache in place instead of copying
every row's blocks first. The worker runs the eager kernels in debug mode, so that a breakpoint in this file
stops in Python; if the native or compiled one cannot run (no C compiler, an inductor bug, tensors a C
kernel does not take) it runs eager (logged once where the kernel is gone for good).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch
import torch.nn.functional as F

from devharness.model import native

logger = logging.getLogger(__name__)


# At most this many rows, a float32 product on the CPU runs as weight @ x^T outside native mode (BLAS then streams
# the weight once against a skinny right-hand side): on a 2-core AVX2 machine 1.3x F.linear's rate at 32 rows with
# every layer's weights coming from memory, 1.5x at 16, 2.5x at 4; from about 96 rows F.linear is as fast or faster.
SKINNY_ROWS = 64
# In native mode every float32 product on the CPU runs the C kernel over the packed weight (native.packed_linear),
# whatever its rows. With every layer's weights coming from memory: on a 2-core AVX-512 Xeon 1.55x MKL's F.linear
# at 32 rows, 1.45x at 64, 1.13x at 128, 1.05x at 256 and 0.95x at 1024 (prefill chunks); on a 2-core AVX-512
# AMD EPYC, where MKL takes its AVX2 path, 3.3x at 32 rows, 2.3x at 256 and 1024.


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; for float32 on the CPU, in native mode the C kernel over a packed copy of the weight
    (native.packed_linear), else (weight @ x^T)^T up to SKINNY_ROWS rows."""
    if x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" \
            and weight.dim() == 2 and x.shape[1] == weight.shape[1]:   # else F.linear names the mismatch
        packed = native.packed_weight(weight) if _native and x.shape[0] else None
        if packed is not None:
            y = native.packed_linear(x, packed, weight.shape[0])
            return y if bias is None else y.add_(bias)
        if 1 < x.shape[0] <= SKINNY_ROWS:
            y = torch.mm(weight, x.t()).t().contiguous()
            return y if bias is None else y.add_(bias)
    return F.linear(x, weight, bias)


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, num_valid: int) -> torch.Tensor | None:
    """argmax(linear(x, weight)[:, :num_valid]) per row (greedy tokens from the LM head) in native mode, in one C
    pass that never writes the logits: the same products as `linear`, so the same tokens; None outside native
    mode or where the C kernel does not take these tensors (the caller computes the logits)."""
    if not _native or x.dim() != 2 or not x.shape[0] or x.dtype != torch.float32 or x.device.type != "cpu" \
            or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return None
    packed = native.packed_weight(weight)
    return None if packed is None else native.packed_linear_argmax(x, packed, weight.shape[0], num_valid)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """silu_and_mul(linear(x, weight, bias)) for a gate/up projection (weight [2I, K], gate rows first) in one C
    kernel, in native mode for float32 rows on the CPU without a bias; None otherwise (the caller runs the
    projection, then silu_and_mul)."""
    if not _native or bias is not None or x.dim() != 2 or not x.shape[0] \
            or x.dtype != torch.float32 or x.device.type != "cpu" or weight.dim() != 2 \
            or x.shape[1] != weight.shape[1]:
        return None
    packed = native.packed_gated_weight(weight)
    return None if packed is None else native.packed_gated_linear(x, packed, weight.shape[0] // 2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _native and (done := native.rms_norm(x, weight, eps)) is not None:
        return done[0]
    if x.dtype == torch.float32:
        # aten's fused kernel: one pass, bit for bit the reference's result in float32.
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream's add, then the next norm."""
    if _native and (done := native.rms_norm(x, weight, eps, residual)) is not None:
        return done
    x = x + residual
    return rms_norm(x, weight, eps), x


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, H, D] by cos/sin [T, 1, D] (already gathered for the positions)."""
    if _native and (done := native.rotate(x, cos, sin)) is not None:
        return done
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if _native and (done := native.silu_and_mul(gate_up)) is not None:
        return done
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of the largest value of each row of x [N, V], the first where several are equal (NaN ranks above
    every number): x.max(dim=-1).indices, which gives argmax's index 2.4x faster on the CPU; in native mode one
    C pass over the rows (a [32, 49152] step's logits: 0.15 ms against about 1 ms)."""
    if _native and x.numel() and (done := native.argmax(x)) is not None:
        return done
    return x.max(dim=-1).indices


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Rows of k and v [T, Hkv, D] into the paged caches [num_blocks, block_size, Hkv, D] at slot_mapping [T]
    (block * block_size + offset): in native mode one C call for both (two index_copy_ cost about 15 us each
    in dispatch, for a few KB), else index_copy_."""
    if _native and native.write_kv(k_cache, v_cache, slot_mapping, k, v):
        return
    hkv, d = k_cache.shape[2:]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row over its cached keys: q [B, Hq, D], caches [num_blocks, block_size, Hkv, D],
    block_tables [B, max_blocks] (padding masked by context_lens [B]). Returns [B, Hq, D].

    Eager: gather whole blocks (index_select) and call SDPA."""
    b, nb = block_tables.shape
    _, bs, hkv, d = k_cache.shape
    flat = block_tables.flatten()
    keys = k_cache.index_select(0, flat).view(b, nb * bs, hkv, d).transpose(1, 2)
    vals = v_cache.index_select(0, flat).view(b, nb * bs, hkv, d).transpose(1, 2)
    mask = torch.arange(nb * bs, device=q.device).unsqueeze(0) < context_lens.unsqueeze(1)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, vals, attn_mask=mask[:, None, None, :],
                                       scale=scale, enable_gqa=True)
    return o.squeeze(2)


def paged_decode_fusable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """paged_decode written as gathers feeding reductions, which inductor fuses into loops that read the
    cache in place: no gathered copy of the keys and values (eager, this form would materialize it)."""
    b, nb = block_tables.shape
    _, bs, hkv, d = k_cache.shape
    group = q.shape[1] // hkv
    pos = torch.arange(nb * bs, device=q.device)
    blocks, offsets = block_tables[:, pos // bs], pos % bs
    keys, vals = k_cache[blocks, offsets], v_cache[blocks, offsets]             # [B, L, Hkv, D]
    scores = (q.view(b, 1, hkv, group, d) * keys[:, :, :, None, :]).sum(-1) * scale   # [B, L, Hkv, G]
    scores = scores.masked_fill(pos[None, :, None, None] >= context_lens[:, None, None, None], float("-inf"))
    probs = scores.softmax(dim=1)
    return (probs[..., None] * vals[:, :, :, None, :]).sum(1).reshape(b, hkv * group, d)


class _CompiledDecode:
    """paged_decode_fusable compiled by inductor, falling back to eager paged_decode for good the first time
    compiling or running it fails while eager succeeds on the same inputs (the error was the compiler's)."""

    def __init__(self):
        self.compiled: Callable | None = torch.compile(paged_decode_fusable)

    def __call__(self, q, k_cache, v_cache, block_tables, context_lens, scale):
        if self.compiled is None:
            return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
        # The batch and the table width change every step: one graph for all of them (after the first call's
        # static one); head counts, head size and block size stay constants that the loops specialize on.
        for t, dim in ((q, 0), (block_tables, 0), (block_tables, 1), (context_lens, 0)):
            torch._dynamo.maybe_mark_dynamic(t, dim)
        try:
            return self.compiled(q, k_cache, v_cache, block_tables, context_lens, scale)
        except Exception as e:
            out = paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
            logger.warning("compiled paged decode attention failed (%s: %s); it runs eager from now on",
                           type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.compiled = None
            return out


_compiled_decode: _CompiledDecode | None = None


def compiled_decode() -> Callable:
    """The compiled decode attention, built once per process (it compiles on its first call)."""
    global _compiled_decode
    if _compiled_decode is None:
        _compiled_decode = _CompiledDecode()
    return _compiled_decode


def native_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """paged_decode by the C kernel (native.py) where it is built and takes these tensors, else eager."""
    if native.supports(q, k_cache, v_cache) and native.decode_kernel() is not None:
        return native.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)


MODES = ("eager", "native", "compiled")
decode = paged_decode   # the decode attention the running forward uses (see `use`)
# Native mode: `linear`, `gated_linear`, the norms, `rotate`, `silu_and_mul` and `write_kv` run the C kernels
# where they take the tensors.
_native = False


@contextlib.contextmanager
def use(mode: str):
    """Run the block's forward with the kernels of `mode` (one of MODES): the decode attention, and in native mode
    the C kernels of the other functions here; the previous ones after."""
    global decode, _native
    if mode not in MODES:
        raise ValueError(f"kernel mode {mode!r}: must be one of {', '.join(MODES)}")
    previous = decode, _native
    decode = paged_decode if mode == "eager" else native_decode if mode == "native" else compiled_decode()
    _native = mode == "native"
    try:
        yield
    finally:
        decode, _native = previous
