"""Llama (and the many checkpoints that call themselves llama): the shared decoder as it is.

config.json's attention_bias puts a bias on q, k, v and o; mlp_bias on the MLP's three projections.
"""
from __future__ import annotations

from devharness.model.arch import ModelArch, read_hf_config
from devharness.model.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    model_types = ("llama",)
    gguf_architecture = "llama"
    gguf_rope_permuted = True

    @classmethod
    def arch_from_hf(cls, cfg: dict, source: str) -> ModelArch:
        bias = bool(cfg.get("attention_bias", False))
        return read_hf_config(cfg, source, architecture=cls.__name__, qkv_bias=bias, o_proj_bias=bias,
                              mlp_bias=bool(cfg.get("mlp_bias", False)))
