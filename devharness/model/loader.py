"""Find a model (built-in name, Hugging Face directory, GGUF file), read its architecture and
tokenizer, and stream its weights into a (possibly sharded, possibly partial) model of its family."""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec
import torch
from torch import nn

from devharness.model.arch import ModelArch
from devharness.model.registry import arch_from_hf_config
from devharness.model.tokenizer import Tokenizer

BUILTIN_MODELS = ("tiny-llama", "smollm2")

# checkpoint name fragment -> (our fused parameter, shard id)
_FUSED = (
    (".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"), (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1),
)
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")


class ModelSource(msgspec.Struct, frozen=True):
    """Where a model's weights come from; small enough to send to every worker."""

    kind: str            # "builtin" | "hf" | "gguf"
    name: str            # what the user asked for
    path: str | None     # directory or .gguf file; None for tiny-llama
    arch: ModelArch


def resolve_model(model: str) -> ModelSource:
    """Identify `model` and read its architecture; raise ValueError naming what is wrong."""
    from devharness.model.builtin import TINY_ARCH

    if model == "tiny-llama":
        return ModelSource("builtin", model, None, TINY_ARCH)
    if model == "smollm2":
        from devharness.model.smollm2 import smollm2_path
        path = smollm2_path()
        return _gguf_source(model, path)
    p = Path(model).expanduser()
    if p.is_dir():
        cfg_file = p / "config.json"
        if not cfg_file.exists():
            raise ValueError(f"model directory {p} has no config.json")
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
        if not list(p.glob("*.safetensors")):
            raise ValueError(f"model directory {p} has no *.safetensors weights")
        return ModelSource("hf", model, str(p), arch_from_hf_config(cfg, str(cfg_file)))
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ValueError(f"GGUF file {p} does not exist")
        return _gguf_source(model, p)
    raise ValueError(f"unknown model {model!r}: give a built-in name ({', '.join(BUILTIN_MODELS)}), "
                     "a Hugging Face directory (config.json + *.safetensors) or a .gguf file")


def _gguf_source(name: str, path: Path) -> ModelSource:
    from devharness.model.gguf_loader import read_gguf_arch
    return ModelSource("gguf", name, str(path), read_gguf_arch(path))


def load_tokenizer(src: ModelSource) -> Tokenizer | None:
    if src.kind == "builtin":
        from devharness.model.builtin import tiny_tokenizer
        return tiny_tokenizer()
    if src.kind == "gguf":
        from devharness.model.gguf_loader import load_gguf_tokenizer
        return load_gguf_tokenizer(Path(src.path))
    return Tokenizer.from_hf_dir(Path(src.path), src.arch.bos_token_id, src.arch.eos_token_ids)


def _layer_of(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def iter_weights(src: ModelSource, dtype: torch.dtype, layer_range: tuple[int, int],
                 seed: int = 0, quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every weight, skipping layers outside `layer_range` unread. `quantized`: a
    GGUF file's Q4_1 and Q8_0 matrices come as QuantizedWeight (their blocks), the rest as tensors."""
    if src.kind == "builtin":
        from devharness.model.builtin import synthetic_weights
        for name, w in synthetic_weights(src.arch, seed).items():
            yield name, w.to(dtype)
    elif src.kind == "gguf":
        from devharness.model.gguf_loader import iter_gguf_weights
        yield from iter_gguf_weights(Path(src.path), dtype, layer_range, quantized)
    else:
        yield from _iter_safetensors(Path(src.path), dtype, layer_range)


def _iter_safetensors(path: Path, dtype, layer_range) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [f for f in files if not (path / f).exists()]
        if missing:
            raise ValueError(f"{index} names shard(s) that are missing: {', '.join(missing)}")
    else:
        files = sorted(f.name for f in path.glob("*.safetensors"))
    from tqdm import tqdm
    bar = tqdm(total=len(files), desc=f"loading {path.name}", unit="file", disable=len(files) < 2 or None)
    for f in files:
        bar.update(1)
        with safe_open(str(path / f), framework="pt") as st:
            for name in st.keys():
                layer = _layer_of(name)
                if layer is not None and not layer_range[0] <= layer < layer_range[1]:
                    continue
                yield name, st.get_tensor(name).to(dtype)
    bar.close()


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy checkpoint tensors into `model` through each parameter's weight_loader (which shards them).

    Names the model doesn't have (another stage's embedding or head) are skipped; a parameter
    the checkpoint never provides is an error naming it.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    tied = getattr(model, "arch", None) is not None and model.arch.tie_word_embeddings
    for name, w in weights:
        if "rotary_emb." in name:
            continue
        targets = [name]
        if tied and name == "model.embed_tokens.weight":
            targets.append("lm_head.weight")
        for target in targets:
            shard = None
            for frag, fused, shard_id in _FUSED:
                if frag in target:
                    target, shard = target.replace(frag, fused), shard_id
                    break
            param = params.get(target)
            if param is None:
                continue
            if shard is None and param.shape != w.shape and getattr(param, "weight_loader", None) is None:
                raise ValueError(f"{source}: weight {name} has shape {tuple(w.shape)}, expected {tuple(param.shape)}")
            loader = getattr(param, "weight_loader", None)
            try:
                if loader is None:
                    param.data.copy_(w)
                elif shard is None:
                    loader(param, w)
                else:
                    loader(param, w, shard)
            except RuntimeError as e:
                raise ValueError(f"{source}: weight {name} of shape {tuple(w.shape)} does not fit "
                                 f"{target} ({e})") from None
            loaded.add(f"{target}:{shard}" if shard is not None else target)
    expected = set()
    for pname in params:
        if pname.endswith("qkv_proj.weight") or pname.endswith("qkv_proj.bias"):
            expected |= {f"{pname}:{s}" for s in "qkv"}
        elif pname.endswith("gate_up_proj.weight") or pname.endswith("gate_up_proj.bias"):
            expected |= {f"{pname}:0", f"{pname}:1"}
        else:
            expected.add(pname)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"{source}: checkpoint lacks {len(missing)} weight(s), e.g. {missing[:3]}")
