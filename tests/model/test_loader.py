"""Loading a Hugging Face directory: sharded safetensors with their index, and what a broken one says."""
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from devharness import LLM, SamplingParams
from tests.helpers import as_inputs, mixed_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def shard(src, dst):
    """Rewrite src's single safetensors file as two shards plus model.safetensors.index.json."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(weights)
    parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fname, keys in parts.items():
        save_file({k: weights[k] for k in keys}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def tokens(path):
    with LLM(str(path)) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(as_inputs(mixed_prompts(3)), GREEDY)]


def test_sharded_checkpoint_loads_the_same_weights(tiny_hf_dir, tmp_path):
    assert tokens(shard(tiny_hf_dir, tmp_path / "sharded")) == tokens(tiny_hf_dir)


def test_missing_shard_is_named(tiny_hf_dir, tmp_path):
    d = shard(tiny_hf_dir, tmp_path / "sharded")
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        LLM(str(d))


def test_missing_weight_is_named(tiny_hf_dir, tmp_path):
    d = shutil.copytree(tiny_hf_dir, tmp_path / "partial")
    weights = load_file(str(d / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate_up_proj"):
        LLM(str(d))


def test_wrong_shape_is_named(tiny_hf_dir, tmp_path):
    d = shutil.copytree(tiny_hf_dir, tmp_path / "reshaped")
    weights = load_file(str(d / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1].clone()
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        LLM(str(d))


def test_unknown_rope_scaling_is_named(tiny_hf_dir, tmp_path):
    d = shutil.copytree(tiny_hf_dir, tmp_path / "yarn")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        LLM(str(d))
