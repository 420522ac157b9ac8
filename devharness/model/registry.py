"""The supported model families and how a checkpoint finds its own: by config.json's `architectures`
(else its `model_type`), by a GGUF file's `general.architecture`, by ModelArch.architecture in a worker.

A new family is a DecoderForCausalLM subclass in its own file (see qwen.py) added to FAMILIES."""
from __future__ import annotations

from devharness.model.arch import ModelArch
from devharness.model.decoder import DecoderForCausalLM
from devharness.model.llama import LlamaForCausalLM
from devharness.model.mistral import MistralForCausalLM
from devharness.model.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

FAMILIES: tuple[type[DecoderForCausalLM], ...] = (
    LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)
_BY_NAME = {f.__name__: f for f in FAMILIES}


def _supported() -> str:
    return ", ".join(f"{f.__name__} (model_type {f.model_types[0]!r})" for f in FAMILIES)


def arch_from_hf_config(cfg: dict, source: str) -> ModelArch:
    """The ModelArch of a parsed config.json, read by its family; ValueError naming `source` and the field."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    family = next((_BY_NAME[a] for a in archs if a in _BY_NAME), None) or \
        next((f for f in FAMILIES if model_type in f.model_types), None)
    if family is None and model_type is None and not archs:
        family = LlamaForCausalLM       # a bare config.json: the Llama layout, as before families existed
    if family is None:
        raise ValueError(f"{source}: model_type {model_type!r} (architectures {archs}) is not supported; "
                         f"devharness runs {_supported()}")
    return family.arch_from_hf(cfg, source)


def family_of_gguf(architecture: str | None, source: str) -> type[DecoderForCausalLM]:
    """The family whose GGUF files say general.architecture `architecture`; ValueError naming `source`."""
    family = next((f for f in FAMILIES if f.gguf_architecture and f.gguf_architecture == architecture), None)
    if family is None:
        known = ", ".join(repr(f.gguf_architecture) for f in FAMILIES if f.gguf_architecture)
        raise ValueError(f"{source}: GGUF architecture {architecture!r} is not supported; devharness reads "
                         f"general.architecture {known}")
    return family


def build_model(arch: ModelArch, pp_rank: int = 0, pp_size: int = 1, max_positions: int | None = None,
                layer_partition: list[int] | None = None) -> DecoderForCausalLM:
    """This pipeline stage of the model `arch` describes, its parameters empty until the loader fills them."""
    family = _BY_NAME.get(arch.architecture)
    if family is None:
        raise ValueError(f"architecture {arch.architecture!r} is not supported (supported: {', '.join(_BY_NAME)})")
    return family(arch, pp_rank, pp_size, max_positions, layer_partition)
