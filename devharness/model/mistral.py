"""Mistral: Llama's layout under its own config class. Its sliding_window (4096 in Mistral 7B v0.1, null
from v0.2) is read by arch.py; the engine refuses a max_model_len longer than the window, as sliding-window
attention is not implemented (up to the window it is plain causal attention)."""
from __future__ import annotations

from devharness.model.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    model_types = ("mistral",)
    # llama.cpp converts Mistral checkpoints to GGUF architecture "llama": they load as LlamaForCausalLM.
