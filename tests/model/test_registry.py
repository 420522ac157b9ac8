"""Which family reads a config.json, and what it reads from real checkpoints' configs (as published,
written by transformers 4: rope_theta at the top, sliding_window kept while use_sliding_window is false)."""
import pytest

from devharness.model.registry import FAMILIES, arch_from_hf_config, build_model

QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896,
    "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "max_window_layers": 21, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "rope_scaling": None, "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": True,
    "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16"}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936, "eos_token_id": 151645}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": False, "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.parametrize("cfg, expected", [
    (QWEN25_05B, dict(architecture="Qwen2ForCausalLM", head_dim=64, qkv_bias=True, o_proj_bias=False,
                      qk_norm=False, tie_word_embeddings=True, sliding_window=None, rope_theta=1e6)),
    (QWEN3_06B, dict(architecture="Qwen3ForCausalLM", head_dim=128, qkv_bias=False, o_proj_bias=False,
                     qk_norm=True, tie_word_embeddings=True, sliding_window=None, rope_theta=1e6)),
    (MISTRAL_7B_V01, dict(architecture="MistralForCausalLM", head_dim=128, qkv_bias=False, qk_norm=False,
                          tie_word_embeddings=False, sliding_window=4096, eos_token_ids=(2,))),
], ids=["qwen2.5-0.5b", "qwen3-0.6b", "mistral-7b-v0.1"])
def test_published_configs_read_as_their_family(cfg, expected):
    arch = arch_from_hf_config(cfg, "config.json")
    assert {k: getattr(arch, k) for k in expected} == expected


def test_model_type_decides_when_architectures_is_unknown():
    cfg = dict(QWEN3_06B, architectures=["Qwen3ForTokenClassification"])
    assert arch_from_hf_config(cfg, "config.json").architecture == "Qwen3ForCausalLM"
    bare = {k: v for k, v in MISTRAL_7B_V01.items() if k not in ("architectures", "model_type")}
    assert arch_from_hf_config(bare, "config.json").architecture == "LlamaForCausalLM"


@pytest.mark.parametrize("changes, message", [
    (dict(model_type="gemma", architectures=["GemmaForCausalLM"]), "model_type 'gemma'"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn'"),
])
def test_what_no_family_runs_is_named(changes, message):
    with pytest.raises(ValueError, match=f"^config.json: .*{message}"):
        arch_from_hf_config(dict(QWEN25_05B, **changes), "config.json")


def test_every_family_builds_its_own_class_with_the_checkpoint_names():
    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2, vocab_size=100)
    for family in FAMILIES:
        cfg = dict(small, architectures=[family.__name__], model_type=family.model_types[0])
        model = build_model(arch_from_hf_config(cfg, "config.json"))
        assert type(model) is family
        names = set(dict(model.named_parameters()))
        assert ("model.layers.1.self_attn.q_norm.weight" in names) == (family.__name__ == "Qwen3ForCausalLM")
        assert ("model.layers.0.self_attn.qkv_proj.bias" in names) == (family.__name__ == "Qwen2ForCausalLM")
