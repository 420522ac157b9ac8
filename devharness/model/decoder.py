"""The decoder every supported family shares: RMSNorm, RoPE, GQA attention over this rank's heads, a
gated (SwiGLU) MLP and tensor-parallel linears with optional biases, switched by ModelArch fields.

A family (llama.py, qwen.py, mistral.py) subclasses DecoderForCausalLM: it declares the names it goes
by (config.json model_type, GGUF architecture) and how its config.json reads; registry.py lists it.
Module names follow the Hugging Face checkpoint (model.layers.N.self_attn.q_proj ...) so the loader
maps names one to one. A pipeline stage builds only its own layers, keyed by their global index, plus
the embedding (first stage) or the final norm and LM head (last stage). The model calls the hooks in
hooks.py and knows nothing of who installed them. In native mode a step of decodes only may run a stage's
layers in one C call instead (tp=1, and only while no installed hook must see each layer): the same kernels in
the same order, so the same values bit for bit, without the Python around each kernel (_decode_layers).
"""
from __future__ import annotations

import torch
from torch import nn

from devharness.distributed.parallel_state import get_parallel_info
from devharness.model import hooks, kernels, native
from devharness.model.arch import ModelArch, read_hf_config
from devharness.model.attention import AttentionMetadata, PagedAttention
from devharness.model.layers import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RMSNorm,
                                     RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding)


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

    def forward(self, positions, hidden, meta: AttentionMetadata, rotary: nn.Module):
        qkv = self.qkv_proj(hidden)
        d = self.head_dim
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q = q.view(-1, self.num_heads, d)
        k = k.view(-1, self.num_kv_heads, d)
        v = v.view(-1, self.num_kv_heads, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q_positions = positions
        for hook in hooks.query_positions:
            q_positions = hook(self.layer_idx, q_positions)
        q, k = rotary(positions, q, k, q_positions)
        out = self.attn(q, k, v, meta)
        for hook in hooks.kv_written:
            hook(self.layer_idx, self.attn.k_cache, self.attn.v_cache, meta.slot_mapping)
        return self.o_proj(out)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up column-parallel in one matmul, down row-parallel."""

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [arch.intermediate_size] * 2,
                                                       bias=arch.mlp_bias)
        self.down_proj = RowParallelLinear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias, name="mlp")

    def forward(self, x):
        # Native mode: the gate/up product and SiLU-and-mul in one kernel (the [T, 2I] product is never made).
        h = kernels.gated_linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        if h is None:
            h = kernels.silu_and_mul(self.gate_up_proj(x))
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
        # The kernels the forward and the LM head use (kernels.MODES); the worker picks them, eager in debug mode.
        self.kernel_mode = "eager"
        self._layer_modules: list[tuple] | None = None   # _layer_table's modules of each layer
        self._table: tuple | None = None   # _layer_table's last table and what it was made of
        # float64 [len(native.DECODE_LAYER_PHASES)] to add the one-call layers' time per phase to (bench throughput)
        self.layer_phase_s: torch.Tensor | None = None
        # Native mode may run a decode step's layers in one C call (_decode_layers) where every layer is this file's
        # DecoderLayer and runs no collective: tp=1, no per-head q/k norms, no MLP biases (which the native MLP
        # product does not take).
        self._layers_fuse = get_parallel_info().tp_size == 1 and not arch.qk_norm and not arch.mlp_bias \
            and bool(self._layers) and all(type(layer) is DecoderLayer for _, layer in self._layers)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers.values()]

    def forward(self, input_ids, positions, meta: AttentionMetadata, hidden=None, residual=None):
        if self.first:
            hidden = self.model.embed_tokens(input_ids)
            residual = None
        rotary = self.model.rotary_emb.for_positions(positions, hidden.dtype)
        starts, ends = hooks.layer_start, hooks.layer_end
        with kernels.use(self.kernel_mode):
            done = self._decode_layers(hidden, residual, meta, rotary) \
                if self._layers_fuse and self.kernel_mode == "native" and not hooks.sees_each_layer() else None
            for idx, layer in self._layers if done is None else ():
                for hook in starts:
                    hook(idx)
                hidden, residual = layer(positions, hidden, residual, meta, rotary)
                for hook in ends:
                    hook(idx, hidden, residual)
            if done is not None:
                hidden, residual = done
        for hook in hooks.layers_done:
            hook()
        if not self.last:
            return hidden, residual
        with kernels.use(self.kernel_mode):   # the final norm too (native: 0.25 -> 0.13 ms at batch 32)
            hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def _decode_layers(self, hidden, residual, meta: AttentionMetadata, rotary) -> tuple | None:
        """(hidden, residual) after this stage's layers, run in one C call (native.decode_layers) for a step of
        decodes only: the module path's kernels in its order, so the same values bit for bit, without its ~200 us
        of Python per layer (a fifth of a batch-32 decode step on a 2-core CPU). None where it does not apply
        (prefill chunks in the step, tensors or weights the kernels do not take): the layers run one by one."""
        groups = meta.decode_groups
        t = hidden.shape[0]
        if meta.prefills or len(groups) != 1 or not t or groups[0].context_lens.shape[0] != t \
                or hidden.dim() != 2 or not native._plain(hidden) or (residual is not None and (
                    residual.shape != hidden.shape or not native._plain(residual))) \
                or native.decode_kernel() is None:
            return None
        group, cos, sin = groups[0], rotary.cos, rotary.sin
        if not native._plain(cos, sin) or cos.shape != (t, 1, self.arch.head_dim) or sin.shape != cos.shape:
            return None
        for x in (meta.slot_mapping, group.block_tables, group.context_lens):
            if x.dtype != torch.int64 or x.device.type != "cpu" or not x.is_contiguous():
                return None
        table = self._layer_table()
        if table is None:
            return None
        attn = self._layers[0][1].self_attn
        k_cache = attn.attn.k_cache
        return native.decode_layers(table, hidden, residual, cos, sin, meta.slot_mapping, group.block_tables,
                                    group.context_lens, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                    self._layers[0][1].mlp.down_proj.weight.shape[1], k_cache.shape[1],
                                    k_cache.shape[0], self._layers[0][1].input_layernorm.eps, attn.attn.scale,
                                    self.layer_phase_s)

    def _layer_table(self) -> torch.Tensor | None:
        """native.decode_layers' table of this stage's layers: the addresses of their packed weights (packed on first
        use, again when a weight changes), norms, biases and caches; None where one is not what the kernels take."""
        if self._layer_modules is None:   # nn.Module attribute lookups cost about 1 us each: looked up once
            self._layer_modules = [(layer.input_layernorm, layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                    layer.post_attention_layernorm, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                                    layer.self_attn.attn) for _, layer in self._layers]
        # The table stands while every tensor in it is the one it was made from (the same storage), unchanged (no
        # version has moved: versions only grow, so their sum moves with any of them): a weight written since is
        # packed again. The parameters are read from the modules' own dicts (nn.Module.__getattr__ costs ~0.5 us a
        # call): about 0.5 ms a batch-32 step for 30 layers (the objects come cold from memory after the last call),
        # 0.15 ms warm.
        tensors = []
        for in_norm, qkv, o, post_norm, gate_up, down, attn in self._layer_modules:
            for m in (in_norm, qkv, o, post_norm, gate_up, down):
                params = m._parameters
                tensors.append(params["weight"])
                if params.get("bias") is not None:
                    tensors.append(params["bias"])
            if attn.k_cache is None or attn.v_cache is None:   # not allocated yet
                return None
            tensors += (attn.k_cache, attn.v_cache)
        # ... and while the kernels are the ones its packs were laid out for (the tests load another build).
        key = (id(native._kernel), sum(t._version for t in tensors), [t.data_ptr() for t in tensors])
        if self._table is not None and self._table[0] == key:
            return self._table[1]
        rows, packs = [], []
        shape = None
        for in_norm, qkv, o, post_norm, gate_up, down, attn in self._layer_modules:
            w_in, w_qkv, w_o, w_post, w_gu, w_down = (in_norm.weight, qkv.weight, o.weight, post_norm.weight,
                                                      gate_up.weight, down.weight)
            p_qkv, p_o = native.packed_weight(w_qkv), native.packed_weight(w_o)
            p_gu, p_down = native.packed_gated_weight(w_gu), native.packed_weight(w_down)
            kc, vc, b_qkv, b_o = attn.k_cache, attn.v_cache, qkv.bias, o.bias
            # `is None` one by one: `None in (tensors)` compares each tensor with None, about 15 us apiece.
            if p_qkv is None or p_o is None or p_gu is None or p_down is None or kc is None or vc is None \
                    or gate_up.bias is not None or down.bias is not None:
                return None
            shape = shape or kc.shape
            h = w_in.shape
            if kc.shape != shape or vc.shape != shape or kc.shape[2:] != (attn.num_kv_heads, attn.head_dim) \
                    or attn.head_dim % 2 or w_post.shape != h or w_o.shape[0] != h[0] \
                    or not native._plain(w_in, w_post, kc, vc) \
                    or (b_qkv is not None and not native._plain(b_qkv)) or (b_o is not None and not native._plain(b_o)):
                return None
            packs += (p_qkv, p_o, p_gu, p_down)
            rows.append((w_in.data_ptr(), p_qkv.data_ptr(), b_qkv.data_ptr() if b_qkv is not None else 0,
                         p_o.data_ptr(), b_o.data_ptr() if b_o is not None else 0, w_post.data_ptr(),
                         p_gu.data_ptr(), p_down.data_ptr(), kc.data_ptr(), vc.data_ptr()))
        table = torch.tensor(rows, dtype=torch.int64)
        self._table = key, table, packs   # the packs it points into live as long as it does
        return table

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with kernels.use(self.kernel_mode):
            return self.lm_head(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """argmax(compute_logits(hidden)) per row, the same tokens, without writing the logits where the kernels
        can (native mode, one TP rank); None otherwise."""
        with kernels.use(self.kernel_mode):
            return self.lm_head.greedy_tokens(hidden)
