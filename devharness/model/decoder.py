"""The decoder every supported family shares: RMSNorm, RoPE, GQA attention over this rank's heads, a
gated (SwiGLU) MLP and tensor-parallel linears with optional biases, switched by ModelArch fields.

A family (llama.py, qwen.py, mistral.py) subclasses DecoderForCausalLM: it declares the names it goes
by (config.json model_type, GGUF architecture) and how its config.json reads; registry.py lists it.
Module names follow the Hugging Face checkpoint (model.layers.N.self_attn.q_proj ...) so the loader
maps names one to one. A pipeline stage builds only its own layers, keyed by their global index, plus
the embedding (first stage) or the final norm and LM head (last stage). The model calls the hooks of its own
HookSet (hooks.py; set_hooks) and knows nothing of who installed them. It computes through the kernels it is handed
(set_kernels: one op registry, whichever backend), and its layer loop is this file's Python in every mode, so
a breakpoint here or in attention.py stops in serving's code. A step of a few decodes replays, layer by layer in
this loop, the kernel calls a layer's Python made at an earlier such step (step_graphs.py: the same bits), except
while a debugger traces the thread or anything else looks inside a layer: then the Python runs.
"""
from __future__ import annotations

import torch
from torch import nn

from devharness.model.hooks import HookSet
from devharness.model.arch import ModelArch, read_hf_config
from devharness.distributed.parallel_state import get_parallel_info
from devharness.model.attention import AttentionMetadata, PagedAttention
from devharness.model.step_graphs import StepGraphs
from devharness.model.layers import (QUANTIZED_TYPE_NAMES, ColumnParallelLinear, MergedColumnParallelLinear,
                                     ParallelLMHead, QKVParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear,
                                     StepRotary, VocabParallelEmbedding)


def stage_layer_range(num_layers: int, pp_size: int, pp_rank: int,
                      partition: list[int] | None = None) -> tuple[int, int]:
    """Layers [start, end) of a stage: `partition[pp_rank]` of them after the earlier stages' when given,
    else an even split where the first `num_layers % pp_size` stages take one extra."""
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} layers")
    if partition is not None:
        if sum(partition) != num_layers:
            raise ValueError(f"pp_layer_partition {','.join(map(str, partition))} gives {sum(partition)} layers; "
                             f"the model has {num_layers}")
        start = sum(partition[:pp_rank])
        return start, start + partition[pp_rank]
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def layer_weights_per_token(arch: ModelArch) -> int:
    """Multiply-adds of one decoder layer's projections for one token (q, k, v, o, gate, up, down)."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    return arch.hidden_size * (2 * q + 2 * kv) + 3 * arch.hidden_size * arch.intermediate_size


def balanced_layer_partition(arch: ModelArch, pp_size: int) -> list[int]:
    """Layers per pipeline stage that even out the stages' matrix products over a workload with as many prompt
    tokens as generated ones. Every token runs every layer; only a generated token (a decode row, or a prompt's
    last) also runs the LM head (vocab x hidden), on the last stage, and for a small model that head weighs several
    layers (SmolLM2's: 8 of its 30). Balanced for decode steps alone (19,11 for SmolLM2 at pp=2), the stages would
    part at every prompt step (19 layers against 11); split evenly, at every decode step (15 against 15 and the
    head): per token of such a workload the last stage counts half the head. The last stage takes the layer count
    that makes the busiest stage least busy (ties: the most layers, the nearer the even split), the other stages
    share the rest as evenly as they can, earlier ones taking one extra. One stage: [num_hidden_layers]."""
    num_layers = arch.num_hidden_layers
    if pp_size < 1 or num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size {pp_size} does not fit the model's {num_layers} layers")
    if pp_size == 1:
        return [num_layers]
    layer, head = layer_weights_per_token(arch), arch.vocab_size * arch.hidden_size

    def busiest(last: int) -> int:   # per prompt token and generated token: the most any stage multiplies
        return max(2 * -(-(num_layers - last) // (pp_size - 1)) * layer, 2 * last * layer + head)

    last = min(range(num_layers - pp_size + 1, 0, -1), key=busiest)
    base, extra = divmod(num_layers - last, pp_size - 1)
    return [base + (1 if i < extra else 0) for i in range(pp_size - 1)] + [last]


class Attention(nn.Module):
    """Self-attention over this rank's query heads and its share of the KV heads (GQA)."""

    def __init__(self, arch: ModelArch, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_attention_heads,
                                          arch.num_key_value_heads, bias=arch.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = arch.head_dim
        # Per-head norms: one weight of head_dim shared by every head, so each rank holds all of it.
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.o_proj = RowParallelLinear(arch.num_attention_heads * arch.head_dim, arch.hidden_size,
                                        bias=arch.o_proj_bias, name="attention")
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)
        self.qkv_heads = [self.num_heads, self.num_kv_heads, self.num_kv_heads]

    def forward(self, positions, hidden, meta: AttentionMetadata, rotary: nn.Module):
        qkv = self.qkv_proj(hidden)
        # q [T, Hq, D], k and v [T, Hkv, D]: views of the product, split by heads (one view and one split: the
        # Python of Tensor.split and a view per part cost as much as a norm's kernel).
        q, k, v = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim).split_with_sizes(
            self.qkv_heads, dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        elif isinstance(rotary, StepRotary) and positions is rotary.positions \
                and self.attn.fuses_rotary(meta, q.shape[0]):
            # A step of decodes alone: RoPE, the cache write and the attention in one op (decode_attention).
            return self.o_proj(self.attn.forward_decodes(q, k, v, rotary.cos, rotary.sin, meta))
        q, k = rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up column-parallel in one matmul, down row-parallel."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [arch.intermediate_size] * 2,
                                                       bias=arch.mlp_bias)
        self.down_proj = RowParallelLinear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias, name="mlp")

    ops = None   # the kernels handed to the model (DecoderForCausalLM.set_kernels)

    def forward(self, x):
        # One op for the gate/up product and SiLU-and-mul: the fast kernel never writes the [T, 2I] product.
        proj = self.gate_up_proj
        if proj.qtype is not None:   # kept in GGUF's blocks
            h = self.ops.q_gated_linear(x, proj.weight, proj.qtype, proj.bias)
        else:
            h = self.ops.gated_linear(x, proj.weight, proj.bias)
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP; the residual stream travels beside the hidden states."""

    def __init__(self, arch: ModelArch, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(arch, layer_idx)
        self.mlp = GatedMLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, positions, hidden, residual, meta, rotary):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta, rotary)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, arch: ModelArch, layer_range: tuple[int, int], first: bool, last: bool,
                 max_positions: int, layer_cls: type[nn.Module]):
        super().__init__()
        self.layer_range = layer_range
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size) if first else None
        self.layers = nn.ModuleDict({str(i): layer_cls(arch, i) for i in range(*layer_range)})
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if last else None
        self.rotary_emb = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)


class DecoderForCausalLM(nn.Module):
    """One pipeline stage of a decoder-only LM. forward() runs this stage's layers: token ids in on the
    first stage, (hidden, residual) in from the previous stage otherwise; the last stage returns final
    hidden states, and compute_logits turns them into logits over the whole vocabulary.

    A family subclass declares the class attributes below and, where its config.json means something
    the shared reading does not, overrides arch_from_hf."""

    model_types: tuple[str, ...] = ()      # config.json "model_type" values that mean this family
    gguf_architecture: str | None = None   # GGUF "general.architecture" of its files
    gguf_rope_permuted = False             # llama.cpp reorders q/k rows for its interleaved RoPE ("llama")
    layer_cls: type[nn.Module] = DecoderLayer

    @classmethod
    def arch_from_hf(cls, cfg: dict, source: str) -> ModelArch:
        """This family's ModelArch from a parsed config.json; `source` names the file in errors."""
        return read_hf_config(cfg, source, architecture=cls.__name__)

    def __init__(self, arch: ModelArch, pp_rank: int = 0, pp_size: int = 1, max_positions: int | None = None,
                 layer_partition: list[int] | None = None):
        super().__init__()
        self.arch = arch
        self.first, self.last = pp_rank == 0, pp_rank == pp_size - 1
        layer_range = stage_layer_range(arch.num_hidden_layers, pp_size, pp_rank, layer_partition)
        self.model = DecoderModel(arch, layer_range, self.first, self.last,
                                  max_positions or arch.max_position_embeddings, self.layer_cls)
        # Tied embeddings: the loader copies embed_tokens into this head, split by vocabulary like the embedding.
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size) if self.last else None
        self._layers = [(int(i), layer) for i, layer in self.model.layers.items()]   # (global index, layer)
        self.kernels = None   # set_kernels: the kernels every layer computes through
        self.tp_size = get_parallel_info().tp_size
        self.step_graphs = StepGraphs(self)
        self.set_hooks(HookSet())

    def set_hooks(self, hooks: HookSet) -> None:
        """Hand the model the HookSet its forward calls (its worker's: what the worker installs there, this model
        alone sees): the decoder loop and every row-parallel projection call it from their next forward."""
        self.hooks = hooks
        for module in self.modules():
            if isinstance(module, RowParallelLinear):
                module.hooks = hooks

    def set_kernels(self, kernels) -> None:
        """Hand the model its kernels (devharness.kernels.Kernels, or any object with its ops): every submodule
        that computes (it declares `ops`) uses them from its next call."""
        self.kernels = kernels
        for module in self.modules():
            if hasattr(type(module), "ops"):
                module.ops = kernels

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers.values()]

    def weights_by_op(self) -> list[tuple[str, torch.Tensor]]:
        """(op, weight) for every weight the forward hands a linear op ("linear", "gated_linear"; the LM head's
        also goes to "linear_argmax", which takes linear's packing): what a backend may prepare ahead."""
        out = []
        for module in self.modules():
            if getattr(module, "qtype", None) is not None or getattr(getattr(module, "gate_up_proj", None),
                                                                       "qtype", None) is not None:
                continue   # kept in GGUF's blocks: the quantized ops read them as they are
            if isinstance(module, GatedMLP):
                out.append(("gated_linear", module.gate_up_proj.weight))
            elif isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)) \
                    and not isinstance(module, MergedColumnParallelLinear):
                out.append(("linear", module.weight))
        return out

    def weight_bytes(self) -> tuple[int, dict[str, int]]:
        """(bytes this stage's weights take, ggml type -> how many checkpoint tensors it keeps in that type's GGUF
        blocks; empty when every weight is float)."""
        total, kept = 0, {}
        for module in self.modules():
            for p in module.parameters(recurse=False):
                total += p.numel() * p.element_size()
            if getattr(module, "qtype", None) is not None:
                name = QUANTIZED_TYPE_NAMES.get(module.qtype, str(module.qtype))
                kept[name] = kept.get(name, 0) + module.shipped
        return total, dict(sorted(kept.items()))

    def forward(self, input_ids, positions, meta: AttentionMetadata, hidden=None, residual=None):
        if self.kernels is None:
            raise RuntimeError("the model has no kernels: hand it some with set_kernels(...) before its forward")
        if self.first:
            hidden = self.model.embed_tokens(input_ids)
            residual = None
        rotary = self.model.rotary_emb.for_positions(positions, hidden.dtype)
        hooks = self.hooks
        starts, ends = hooks.layer_start, hooks.layer_end
        # A step of a few decodes: each layer as the kernel calls its Python made at an earlier such step (replayed:
        # the same bits), where nothing looks inside the layers (step_graphs.py); None: the Python runs.
        step = self.step_graphs.step(hidden, residual, positions, meta, rotary)
        finished = False
        try:
            for idx, layer in self._layers:
                for hook in starts:
                    hook(idx)
                if step is None:
                    hidden, residual = layer(positions, hidden, residual, meta, rotary)
                else:
                    hidden, residual = step.layer(idx, layer, positions, hidden, residual, meta, rotary)
                for hook in ends:
                    hook(idx, hidden, residual)
            finished = True
        finally:
            if step is not None:   # a capture ends here, whatever happened in the layers
                hidden, residual = step.done(hidden, residual, finished)
        for hook in hooks.layers_done:
            hook()
        if not self.last:
            return hidden, residual
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """argmax(compute_logits(hidden)) per row, the same tokens, through the linear_argmax op (whose fast kernel
        never writes the logits), where this rank holds the whole vocabulary (one TP rank); None otherwise."""
        return self.lm_head.greedy_tokens(hidden)
