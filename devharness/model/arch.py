"""The architecture of a decoder checkpoint, independent of where it was read from (config.json or GGUF).

ModelArch holds the shapes and the switches the shared decoder (decoder.py) honours; a family
(llama.py, qwen.py, mistral.py) reads its config.json into one with `read_hf_config`, declaring what
its config does not say (Qwen2's q/k/v biases, Qwen3's q/k norms)."""
from __future__ import annotations

import msgspec


class RopeScaling(msgspec.Struct, frozen=True):
    """`rope_scaling` from config.json: kind "linear" or "llama3" (None means plain RoPE)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelArch(msgspec.Struct, frozen=True):
    """Shapes and constants of a decoder; HF config.json names where they exist. `architecture` names
    the family's model class (registry.py); the flags after it switch shared pieces on."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    qkv_bias: bool = False          # a bias on q_proj, k_proj and v_proj (sharded with their heads)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False           # RMSNorm over each head's q and k before RoPE (self_attn.q_norm, k_norm)
    sliding_window: int | None = None   # attention span in tokens; not implemented, so max_model_len must fit in it


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_hf_config(cfg: dict, source: str, **declared) -> ModelArch:
    """A ModelArch from a parsed config.json (`source` names the file in errors); `declared` sets what the
    family fixes rather than reads (architecture, qkv_bias=True, ...)."""
    if missing := [k for k in _REQUIRED if k not in cfg]:
        raise ValueError(f"{source}: missing field(s) {', '.join(missing)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (supported: silu)")
    heads = cfg["num_attention_heads"]
    # transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; older files rope_theta + rope_scaling.
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
    eos = cfg.get("eos_token_id")
    # Qwen2/Qwen3 keep a sliding_window value while use_sliding_window is false: then it is off.
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    fields = dict(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), rope_theta=float(theta),
        rope_scaling=_rope_scaling(rope, source),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        sliding_window=int(window) if window is not None else None)
    return ModelArch(**{**fields, **declared})


def _rope_scaling(rs: dict, source: str) -> RopeScaling | None:
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported (supported: linear, llama3)")
    return RopeScaling(
        rope_type=kind, factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)))


def arch_to_hf_config(arch: ModelArch, torch_dtype: str = "float32") -> dict:
    """The config.json that transformers' LlamaForCausalLM reads for this (Llama) architecture."""
    if arch.qkv_bias != arch.o_proj_bias or arch.qk_norm or arch.architecture != "LlamaForCausalLM":
        raise ValueError(f"arch_to_hf_config writes Llama configs; {arch.architecture} with qkv_bias="
                         f"{arch.qkv_bias}, o_proj_bias={arch.o_proj_bias}, qk_norm={arch.qk_norm} is not one")
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size, "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads, "head_dim": arch.head_dim,
        "rms_norm_eps": arch.rms_norm_eps, "rope_theta": arch.rope_theta,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings, "hidden_act": "silu",
        "attention_bias": arch.qkv_bias, "mlp_bias": arch.mlp_bias,
        "torch_dtype": torch_dtype,
    }
    if arch.bos_token_id is not None:
        cfg["bos_token_id"] = arch.bos_token_id
    if arch.eos_token_ids:
        cfg["eos_token_id"] = list(arch.eos_token_ids) if len(arch.eos_token_ids) > 1 else arch.eos_token_ids[0]
    if arch.rope_scaling is not None:
        cfg["rope_scaling"] = msgspec.to_builtins(arch.rope_scaling)
    return cfg
