"""Tensor-parallel building blocks. Each layer shards its own weights (via a `weight_loader`
on the parameter, called by the generic loader) and keeps its collective inside forward. Each computes
through `self.ops`, the kernels the model was handed (DecoderForCausalLM.set_kernels): it names an op,
never a backend."""
from __future__ import annotations

import logging
import math

import gguf
import gguf.quants
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from devharness.model.hooks import HookSet
from devharness.model.arch import RopeScaling
from devharness.distributed.collectives import tp_all_gather_last_dim, tp_all_reduce
from devharness.distributed.parallel_state import get_parallel_info

logger = logging.getLogger(__name__)

# ggml type -> bytes a block of 32 weights takes, for the types whose blocks the kernels compute with
# (devharness.kernels.reference.BLOCK_BYTES): Q4_1 and Q8_0.
QUANTIZED_BLOCK_BYTES = {int(gguf.GGMLQuantizationType.Q4_1): 20, int(gguf.GGMLQuantizationType.Q8_0): 34}
QUANTIZED_TYPE_NAMES = {t: gguf.GGMLQuantizationType(t).name for t in QUANTIZED_BLOCK_BYTES}


class QuantizedWeight:
    """A weight [N, K] as a GGUF file ships it: `blocks` uint8 [N, K / 32 * block bytes] of ggml type `qtype`
    (Q4_1 or Q8_0), rows of 32-weight blocks. What the GGUF loader hands a layer's weight_loader in place of a
    float tensor; the layer keeps the blocks and computes through its ops' quantized forms."""

    def __init__(self, blocks: torch.Tensor, qtype: int, name: str = ""):
        size = QUANTIZED_BLOCK_BYTES[qtype]
        self.blocks, self.qtype, self.name = blocks, qtype, name
        self.shape = torch.Size((blocks.shape[0], blocks.shape[1] // size * 32))

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedWeight | None":
        """Rows (dim 0) or columns (dim 1) start:start + length; None where columns would cut a block."""
        if dim == 0:
            return QuantizedWeight(self.blocks.narrow(0, start, length), self.qtype, self.name)
        if start % 32 or length % 32:
            return None
        size = QUANTIZED_BLOCK_BYTES[self.qtype]
        return QuantizedWeight(self.blocks.narrow(1, start // 32 * size, length // 32 * size), self.qtype, self.name)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], as gguf.quants.dequantize reads the blocks."""
        array = gguf.quants.dequantize(self.blocks.contiguous().numpy(), gguf.GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(array)).reshape(self.shape)


def _shard(full, dim: int, rank: int, size: int):
    step = full.shape[dim] // size
    return full.narrow(dim, rank * step, step)


class _Quantizable:
    """A layer whose `weight` may be kept in GGUF's blocks: `qtype` is then the ggml type and `weight` uint8
    [N, K / 32 * block bytes] (QuantizedWeight's blocks), else None and `weight` the float matrix. The first shard
    a weight_loader writes decides; a later shard of another type (a fused projection of mixed types) turns the
    whole weight to float, as does a shard whose columns would cut a block (a row-parallel split of K)."""

    qtype: int | None = None
    shipped = 0   # how many checkpoint tensors (q, k and v each count) the weight holds in their blocks
    _written = False

    def _write(self, param: nn.Parameter, loaded, rows: tuple[int, int] | None = None, zero: bool = False) -> None:
        """Write `loaded` (a float tensor, a QuantizedWeight, or None: a shard that cut a block, which the caller
        passes dequantized instead) into param's rows (start, length) (None: all of them)."""
        quantized = isinstance(loaded, QuantizedWeight)
        if quantized and self._written and self.qtype != loaded.qtype:
            loaded = loaded.dequantize()   # the weight's first shards were float or another type
            quantized = False
        if quantized and not self._written:
            self.qtype = loaded.qtype
            param.data = torch.zeros(param.shape[0], loaded.blocks.shape[1], dtype=torch.uint8,
                                     device=param.device)
        elif not quantized and self.qtype is not None:
            logger.info("%s: a shard of another type; the whole weight runs dequantized", getattr(loaded, "name", ""))
            param.data = QuantizedWeight(param.data, self.qtype).dequantize().to(param.device)
            self.qtype, self.shipped = None, 0
        self._written = True
        self.shipped += quantized
        dst = param.data if rows is None else param.data.narrow(0, *rows)
        src = loaded.blocks if quantized else loaded
        if zero:
            param.data.zero_()
            dst = dst.narrow(0, 0, src.shape[0])
        dst.copy_(src)

    def float_weight(self) -> torch.Tensor:
        """The weight as float32 (dequantized where it is kept in blocks): what a hook that recomputes the product
        reads."""
        return self.weight if self.qtype is None else QuantizedWeight(self.weight, self.qtype).dequantize()


class RMSNorm(nn.Module):
    ops = None   # the kernels handed to the model (set_kernels)

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Plain norm, or (norm(x + residual), x + residual) when a residual is passed."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class ColumnParallelLinear(_Quantizable, nn.Module):
    """y = x A^T with A's output rows split across TP ranks; no communication. A weight in GGUF's blocks splits
    by rows as a float one does."""

    ops = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        info = get_parallel_info()
        self.tp_rank, self.tp_size = info.tp_rank, info.tp_size
        if out_features % self.tp_size:
            raise ValueError(f"output size {out_features} is not divisible by tensor_parallel_size {self.tp_size}")
        self.weight = nn.Parameter(torch.empty(out_features // self.tp_size, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // self.tp_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
        if param is self.weight:
            self._write(param, _shard(loaded, 0, self.tp_rank, self.tp_size))
        else:
            param.data.copy_(_shard(loaded, 0, self.tp_rank, self.tp_size))

    def forward(self, x):
        if self.qtype is not None:
            return self.ops.q_linear(x, self.weight, self.qtype, self.bias)
        return self.ops.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input stored as one (gate_proj + up_proj)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def weight_loader(self, param, loaded, shard_id: int):
        offset = sum(self.out_sizes[:shard_id]) // self.tp_size
        size = self.out_sizes[shard_id] // self.tp_size
        if param is self.weight:
            self._write(param, _shard(loaded, 0, self.tp_rank, self.tp_size), (offset, size))
        else:
            param.data.narrow(0, offset, size).copy_(_shard(loaded, 0, self.tp_rank, self.tp_size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; this rank's query heads and its (possibly replicated) KV heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        info = get_parallel_info()
        tp = info.tp_size
        if num_heads % tp:
            raise ValueError(f"num_attention_heads {num_heads} is not divisible by tensor_parallel_size {tp}")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(f"num_key_value_heads {num_kv_heads} and tensor_parallel_size {tp}: "
                             "one must divide the other")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        # With more ranks than KV heads, each KV head is replicated on tp // num_kv_heads ranks.
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_head_start = (info.tp_rank * num_kv_heads) // tp if tp > num_kv_heads else info.tp_rank * self.num_kv_heads
        nn.Module.__init__(self)
        self.tp_rank, self.tp_size = info.tp_rank, tp
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.weight = nn.Parameter(torch.empty(out, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id: str):
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            rows, src = (0, q_size), loaded.narrow(0, self.tp_rank * q_size, q_size)
        else:
            off = q_size if shard_id == "k" else q_size + kv_size
            rows, src = (off, kv_size), loaded.narrow(0, self.kv_head_start * d, kv_size)
        if param is self.weight:
            self._write(param, src, rows)
        else:
            param.data.narrow(0, *rows).copy_(src)


class RowParallelLinear(_Quantizable, nn.Module):
    """y = x A^T with A's input columns split across TP ranks; partial sums are all-reduced. A weight in GGUF's
    blocks stays in them where each rank's columns are whole blocks, else it is dequantized (logged).
    `name` says whose all-reduce it is in the worker's state ("layer 3 mlp all_reduce"). `hooks`: its model's
    HookSet (DecoderForCausalLM.set_hooks), told of the partial sum and the output."""

    ops = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False, name: str = ""):
        super().__init__()
        self.site = name
        self.hooks = HookSet()   # the model's, once it is part of one
        self.collective = f"{name} all_reduce" if name else "all_reduce"
        info = get_parallel_info()
        self.tp_rank, self.tp_size = info.tp_rank, info.tp_size
        if in_features % self.tp_size:
            raise ValueError(f"input size {in_features} is not divisible by tensor_parallel_size {self.tp_size}")
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.tp_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = lambda p, w, s=None: p.data.copy_(w)

    def weight_loader(self, param, loaded, shard_id=None):
        part = _shard(loaded, 1, self.tp_rank, self.tp_size)
        if part is None:   # this rank's columns would cut 32-weight blocks
            logger.info("%s: %d input columns over %d ranks cut its 32-weight blocks; it runs dequantized",
                        loaded.name, loaded.shape[1], self.tp_size)
            part = _shard(loaded.dequantize(), 1, self.tp_rank, self.tp_size)
        self._write(param, part)

    def forward(self, x):
        if self.qtype is not None:
            y = self.ops.q_linear(x, self.weight, self.qtype)
        else:
            y = self.ops.linear(x, self.weight)
        for hook in self.hooks.partial_sum:
            hook(self.site, x, self.float_weight(), y)
        for hook in self.hooks.partial_output:
            hook(self.site, y)
        y = tp_all_reduce(y, self.collective)
        if self.bias is not None:
            y = y + self.bias
        for hook in self.hooks.sublayer_output:
            hook(self.site, y)
        return y


class VocabParallelEmbedding(_Quantizable, nn.Module):
    """Each TP rank holds a contiguous slice of the (padded) vocabulary; lookups are summed over ranks. A table in
    GGUF's blocks splits by rows (tokens) as a float one does; padding rows are zero blocks (zero weights)."""

    ops = None

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        info = get_parallel_info()
        self.tp_rank, self.tp_size = info.tp_rank, info.tp_size
        self.vocab_size = vocab_size
        self.shard_size = math.ceil(vocab_size / self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        start = min(self.vocab_start, loaded.shape[0])
        self._write(param, loaded.narrow(0, start, min(self.shard_size, loaded.shape[0] - start)), zero=True)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qtype is not None:
            return self.ops.q_embedding(ids, self.weight, self.qtype)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tp_all_reduce(out, "embedding all_reduce")


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, vocabulary split like the embedding; full logits gathered for sampling."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.qtype is not None:
            logits = self.ops.q_linear(hidden, self.weight, self.qtype)
        else:
            logits = self.ops.linear(hidden, self.weight)
        logits = tp_all_gather_last_dim(logits)
        return logits[..., :self.vocab_size]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of forward(hidden) (the linear_argmax op: the fast kernel never writes the logits),
        where this rank holds the whole vocabulary; None otherwise (the caller computes the logits)."""
        if self.tp_size != 1:
            return None
        if self.qtype is not None:
            return self.ops.q_linear_argmax(hidden, self.weight, self.qtype, self.vocab_size)
        return self.ops.linear_argmax(hidden, self.weight, self.vocab_size)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    # float32 throughout, as the reference implementation computes it, so positions match bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the Hugging Face Llama layout), cos/sin precomputed for every position."""

    ops = None

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D], both rotated by `positions`."""
        return self.for_positions(positions, q.dtype)(positions, q, k)

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> "StepRotary":
        """This rotary with cos/sin gathered once for a forward's `positions`, not once per layer."""
        return StepRotary(self, positions, self._tables(positions, dtype))

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # index_select, not indexing: the same rows without the Python of tensor indexing.
        cos, sin = self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)
        return (cos, sin) if dtype == cos.dtype else (cos.to(dtype), sin.to(dtype))


class StepRotary:
    """RotaryEmbedding's call for one forward: every layer rotates by the same positions' cos/sin."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]):
        self.rotary, self.positions, (self.cos, self.sin) = rotary, positions, tables

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """(q, k) rotated: the queries first, then the keys."""
        rotate = self.rotary.ops.rotate
        cos, sin = (self.cos, self.sin) if positions is self.positions else self.rotary._tables(positions, q.dtype)
        return rotate(q, cos, sin), rotate(k, cos, sin)
