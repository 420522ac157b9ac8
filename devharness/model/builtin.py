"""`tiny-llama`: a small Llama with synthetic weights made from a seed, and a byte-level tokenizer.

No files, loads instantly; head counts divide by 1, 2 and 4 so every tp in tests fits. The
weights are scaled so greedy decoding wanders (diverse tokens) instead of locking onto one.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from devharness.model.arch import ModelArch, arch_to_hf_config
from devharness.model.tokenizer import Tokenizer

NUM_BYTE_TOKENS = 256
BOS, EOS = "<s>", "</s>"
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

TINY_ARCH = ModelArch(
    vocab_size=264, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=16, rms_norm_eps=1e-5,
    rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False,
    bos_token_id=256, eos_token_ids=(257,))


def synthetic_weights(arch: ModelArch, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face-named float32 weights drawn from `seed` (the same on every machine)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std):   # on the host, like weights read from files: the loader copies them to the device
        return torch.randn(*shape, generator=g, device="cpu") * std

    h, inter, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    w = {"model.embed_tokens.weight": randn(arch.vocab_size, h, std=1.0)}
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = randn(arch.num_attention_heads * d, h, std=2.0 / h ** 0.5)
        w[p + "self_attn.k_proj.weight"] = randn(arch.num_key_value_heads * d, h, std=2.0 / h ** 0.5)
        w[p + "self_attn.v_proj.weight"] = randn(arch.num_key_value_heads * d, h, std=1.0 / h ** 0.5)
        w[p + "self_attn.o_proj.weight"] = randn(h, arch.num_attention_heads * d, std=1.0 / h ** 0.5)
        w[p + "mlp.gate_proj.weight"] = randn(inter, h, std=1.0 / h ** 0.5)
        w[p + "mlp.up_proj.weight"] = randn(inter, h, std=1.0 / h ** 0.5)
        w[p + "mlp.down_proj.weight"] = randn(h, inter, std=1.0 / inter ** 0.5)
        w[p + "input_layernorm.weight"] = 1.0 + randn(h, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1.0 + randn(h, std=0.1)
    w["model.norm.weight"] = 1.0 + randn(h, std=0.1)
    if not arch.tie_word_embeddings:
        w["lm_head.weight"] = randn(arch.vocab_size, h, std=4.0 / h ** 0.5)
    return w


def _byte_level_alphabet() -> list[str]:
    return sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))


def _byte_of(ch: str) -> int:
    # GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to 256 + n.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def byte_tokenizer(vocab_size: int = TINY_ARCH.vocab_size) -> HFTokenizer:
    """Byte-level BPE with no merges: token id = byte value; 256 <s>, 257 </s>, the rest reserved."""
    vocab = {c: i for i, c in enumerate(_byte_level_alphabet())}
    specials = [BOS, EOS] + [f"<|reserved_{i}|>" for i in range(vocab_size - NUM_BYTE_TOKENS - 2)]
    for i, s in enumerate(specials):
        vocab[s] = NUM_BYTE_TOKENS + i
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return tok


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer(byte_tokenizer(), bos_token_id=256, eos_token_ids=(257,), chat_template=TINY_CHAT_TEMPLATE,
                     add_bos=True, bos_token=BOS, eos_token=EOS)


def write_hf_checkpoint(path: str | Path, arch: ModelArch = TINY_ARCH, seed: int = 0,
                        dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json, model.safetensors and the tokenizer files: a checkpoint transformers can load."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype_name = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(arch_to_hf_config(arch, dtype_name), indent=2))
    weights = {k: v.to(dtype).contiguous() for k, v in synthetic_weights(arch, seed).items()}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    byte_tokenizer(arch.vocab_size).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "chat_template": TINY_CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    return path
