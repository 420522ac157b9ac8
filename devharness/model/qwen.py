"""Qwen2 and Qwen3: the shared decoder with Qwen2's q/k/v biases or Qwen3's per-head q/k RMSNorm.

Qwen2 always has a bias on q, k and v (never on o_proj), whatever config.json says; its small sizes tie
the LM head to the embedding. Qwen3 drops the biases (unless attention_bias) and normalizes each head's
q and k over head_dim before RoPE; its head_dim is given, not hidden_size / num_attention_heads.
Both write sliding_window even when use_sliding_window is false: arch.py reads that as off.
"""
from __future__ import annotations

from devharness.model.arch import ModelArch, read_hf_config
from devharness.model.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    model_types = ("qwen2",)
    gguf_architecture = "qwen2"

    @classmethod
    def arch_from_hf(cls, cfg: dict, source: str) -> ModelArch:
        return read_hf_config(cfg, source, architecture=cls.__name__, qkv_bias=True)


class Qwen3ForCausalLM(DecoderForCausalLM):
    model_types = ("qwen3",)
    gguf_architecture = "qwen3"

    @classmethod
    def arch_from_hf(cls, cfg: dict, source: str) -> ModelArch:
        bias = bool(cfg.get("attention_bias", False))
        return read_hf_config(cfg, source, architecture=cls.__name__, qk_norm=True, qkv_bias=bias,
                              o_proj_bias=bias)
