"""The architecture of a Llama-family checkpoint, independent of where it was read from."""
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
    """Shapes and constants of a Llama decoder; HF config.json names where they exist."""

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
    attention_bias: bool = False
    mlp_bias: bool = False


def arch_from_hf_config(cfg: dict, source: str) -> ModelArch:
    """Build a ModelArch from a parsed config.json; `source` names the file in errors."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if model_type not in (None, "llama") and not any("Llama" in a for a in archs):
        raise ValueError(
            f"{source}: model_type {model_type!r} / architectures {archs} is not supported; "
            "devharness runs Llama-family decoders (model_type 'llama')")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                           "num_hidden_layers", "num_attention_heads") if k not in cfg]
    if missing:
        raise ValueError(f"{source}: missing field(s) {', '.join(missing)}")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rs = cfg.get("rope_scaling")
    scaling = None
    if rs:
        kind = rs.get("rope_type") or rs.get("type")
        if kind not in ("linear", "llama3", "default"):
            raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported "
                             "(supported: linear, llama3)")
        if kind != "default":
            scaling = RopeScaling(
                rope_type=kind, factor=float(rs.get("factor", 1.0)),
                low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)))
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelArch(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads", heads),
        head_dim=head_dim, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)), rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)))


def arch_to_hf_config(arch: ModelArch, torch_dtype: str = "float32") -> dict:
    """The config.json that transformers' LlamaForCausalLM reads for this architecture."""
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size, "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads, "head_dim": arch.head_dim,
        "rms_norm_eps": arch.rms_norm_eps, "rope_theta": arch.rope_theta,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings, "hidden_act": "silu",
        "attention_bias": arch.attention_bias, "mlp_bias": arch.mlp_bias,
        "torch_dtype": torch_dtype,
    }
    if arch.bos_token_id is not None:
        cfg["bos_token_id"] = arch.bos_token_id
    if arch.eos_token_ids:
        cfg["eos_token_id"] = list(arch.eos_token_ids) if len(arch.eos_token_ids) > 1 else arch.eos_token_ids[0]
    if arch.rope_scaling is not None:
        cfg["rope_scaling"] = msgspec.to_builtins(arch.rope_scaling)
    return cfg
