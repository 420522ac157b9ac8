"""A GGUF file as shipped: a tiny Llama-architecture checkpoint (transformers' Mistral, written by the tests) stored
in Q8_0 (embedding, attention) and Q4_1 (MLP), one tensor in Q5_0, loads with its Q4_1 and Q8_0 weights kept in
their blocks (the quantized ops multiply by them) and gives the greedy tokens of the same file dequantized
(--dequantize); the Q5_0 tensor is dequantized, named in one log line; a file cut inside a tensor's blocks is an
error naming the file. The file is written as llama.cpp's "llama" files are read (q/k rows unpermuted on loading),
so the blocks' rows move as the float rows do."""
from __future__ import annotations

import logging

import gguf
import pytest
import torch

from devharness import LLM, SamplingParams
from devharness.model.gguf_loader import iter_gguf_weights
from devharness.model.layers import QuantizedWeight
from tests.model.families import FAMILIES, MAX_NEW_TOKENS, prompt_ids, write_checkpoint, write_gguf

pytestmark = pytest.mark.engine

Q = gguf.GGMLQuantizationType
LLAMA = next(f for f in FAMILIES if f.name == "mistral")   # LlamaForCausalLM's layers under another name


def _types(layers: int) -> dict[str, Q]:
    types = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q8_0}
    for i in range(layers):
        types.update({f"blk.{i}.attn_{p}.weight": Q.Q8_0 for p in ("q", "k", "v", "output")})
        types.update({f"blk.{i}.ffn_{p}.weight": Q.Q4_1 for p in ("gate", "up", "down")})
    types["blk.1.ffn_down.weight"] = Q.Q5_0   # a type the kernels do not read
    return types


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    hf = write_checkpoint(LLAMA, root / "hf")
    path = write_gguf(hf, root / "tiny-llama-q.gguf", "llama", _types(LLAMA.config["num_hidden_layers"]))
    return hf, path


def _greedy(checkpoint, **kw) -> list[list[int]]:
    hf, path = checkpoint
    with LLM(str(path), **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids(hf)],
                            SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_weights_come_as_their_blocks(checkpoint, caplog):
    _, path = checkpoint
    with caplog.at_level(logging.INFO, logger="devharness.model.gguf_loader"):
        got = dict(iter_gguf_weights(path, torch.float32, quantized=True))
    assert [r.getMessage() for r in caplog.records if "Q5_0" in r.getMessage()] and \
        len([r for r in caplog.records if "dequantized" in r.getMessage()]) == 1
    plain = dict(iter_gguf_weights(path, torch.float32))
    kept = {name for name, w in got.items() if isinstance(w, QuantizedWeight)}
    assert "model.embed_tokens.weight" in kept and "model.layers.0.mlp.down_proj.weight" in kept
    assert "model.layers.1.mlp.down_proj.weight" not in kept                     # Q5_0: dequantized
    for name in kept:   # the blocks dequantize to the loader's float weights (q/k rows unpermuted alike)
        assert torch.equal(got[name].dequantize(), plain[name]), name


def test_quantized_greedy_equals_its_dequantized_self(checkpoint, caplog):
    with caplog.at_level(logging.INFO):
        quantized = _greedy(checkpoint)
    assert any("weights as shipped (Q4_1, Q8_0 blocks)" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        dequantized = _greedy(checkpoint, dequantize=True)
    assert any("weights dequantized" in r.getMessage() for r in caplog.records)
    assert quantized == dequantized
    assert _greedy(checkpoint, kernels="reference") == quantized   # the quantized ops' references


def test_a_file_cut_inside_a_tensor_names_it(checkpoint, tmp_path):
    _, path = checkpoint
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])   # the last tensor loses part of its last blocks
    with pytest.raises(ValueError, match=r"cut\.gguf"):
        list(iter_gguf_weights(cut, torch.float32, quantized=True))
