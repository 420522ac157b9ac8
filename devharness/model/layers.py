"""Tensor-parallel building blocks. Each layer shards its own weights (via a `weight_loader`
on the parameter, called by the generic loader) and keeps its collective inside forward. Each computes
through `self.ops`, the kernels the model was handed (DecoderForCausalLM.set_kernels): it names an op,
never a backend."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from devharness.model.hooks import HookSet
from devharness.model.arch import RopeScaling
from devharness.distributed.collectives import tp_all_gather_last_dim, tp_all_reduce
from devharness.distributed.parallel_state import get_parallel_info


def _shard(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    step = full.shape[dim] // size
    return full.narrow(dim, rank * step, step)


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


class ColumnParallelLinear(nn.Module):
    """y = x A^T with A's output rows split across TP ranks; no communication."""

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
        param.data.copy_(_shard(loaded, 0, self.tp_rank, self.tp_size))

    def forward(self, x):
        return self.ops.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input stored as one (gate_proj + up_proj)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def weight_loader(self, param, loaded, shard_id: int):
        offset = sum(self.out_sizes[:shard_id]) // self.tp_size
        size = self.out_sizes[shard_id] // self.tp_size
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
            dst, src = param.data.narrow(0, 0, q_size), loaded.narrow(0, self.tp_rank * q_size, q_size)
        else:
            off = q_size if shard_id == "k" else q_size + kv_size
            dst, src = param.data.narrow(0, off, kv_size), loaded.narrow(0, self.kv_head_start * d, kv_size)
        dst.copy_(src)


class RowParallelLinear(nn.Module):
    """y = x A^T with A's input columns split across TP ranks; partial sums are all-reduced.
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
        param.data.copy_(_shard(loaded, 1, self.tp_rank, self.tp_size))

    def forward(self, x):
        y = self.ops.linear(x, self.weight)
        for hook in self.hooks.partial_sum:
            hook(self.site, x, self.weight, y)
        y = tp_all_reduce(y, self.collective)
        if self.bias is not None:
            y = y + self.bias
        for hook in self.hooks.sublayer_output:
            hook(self.site, y)
        return y


class VocabParallelEmbedding(nn.Module):
    """Each TP rank holds a contiguous slice of the (padded) vocabulary; lookups are summed over ranks."""

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
        rows = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        param.data.zero_()
        param.data[:rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tp_all_reduce(out, "embedding all_reduce")


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, vocabulary split like the embedding; full logits gathered for sampling."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.ops.linear(hidden, self.weight)
        logits = tp_all_gather_last_dim(logits)
        return logits[..., :self.vocab_size]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of forward(hidden) (the linear_argmax op: the fast kernel never writes the logits),
        where this rank holds the whole vocabulary; None otherwise (the caller computes the logits)."""
        if self.tp_size != 1:
            return None
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
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


class StepRotary:
    """RotaryEmbedding's call for one forward: every layer rotates by the same positions' cos/sin."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]):
        self.rotary, self.positions, (self.cos, self.sin) = rotary, positions, tables

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """(q, k) rotated: the queries first, then the keys."""
        rotate = self.rotary.ops.rotate
        cos, sin = (self.cos, self.sin) if positions is self.positions else self.rotary._tables(positions, q.dtype)
        return rotate(q, cos, sin), rotate(k, cos, sin)
