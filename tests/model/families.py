"""Tiny checkpoints of each family written by transformers' own classes (random weights from a seed, sharded
safetensors, a byte-level BPE tokenizer), transformers' greedy tokens on them, and a GGUF writer for them."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer split (llama.cpp's "qwen2"): Llama 3's with every digit on its own.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = ("The quick brown fox jumps over the lazy dog. Pipeline stages pass hidden states; tensor parallel "
          "ranks all-reduce their partial sums. In 2026 the cache held 512 blocks of 16 tokens each. "
          "def forward(self, x): return self.down(silu(self.gate(x)) * self.up(x))\n") * 4
PROMPTS = [
    "The quick brown fox",
    "Pipeline stages pass hidden states to the next stage, and",
    "In 2026 the cache held",
    "def forward(self, x):\n    return",
    "tensor parallel ranks all-reduce their partial sums; the lazy dog jumps over the quick brown fox while "
    "the cache holds 512 blocks",
    "x",
]
MAX_NEW_TOKENS = 24
VOCAB_SIZE = 320      # more rows than the tokenizer has ids, as in Qwen's checkpoints


@dataclass(frozen=True)
class Family:
    """One tiny checkpoint: the transformers config class and its fields, and the seed of its weights."""

    name: str
    config_class: str
    model_class: str
    config: dict = field(default_factory=dict)
    seed: int = 0


COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              bos_token_id=None, eos_token_id=None)   # none: transformers' generate would stop at an EOS
FAMILIES = [
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM",
           dict(COMMON, num_hidden_layers=4, tie_word_embeddings=True, rope_theta=1e6), seed=3),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM",
           dict(COMMON, num_hidden_layers=3, head_dim=32, tie_word_embeddings=False), seed=0),
    Family("mistral", "MistralConfig", "MistralForCausalLM",
           dict(COMMON, num_hidden_layers=2, sliding_window=None, tie_word_embeddings=False), seed=3),
]


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE (every byte a token, a few dozen merges) with Qwen2's split; ids 0-2 are SPECIALS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    return tok


def _randomize(model, seed: int) -> None:
    """Weights scaled so greedy decoding wanders instead of repeating; biases and norms away from 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise * (0.5 if model.config.tie_word_embeddings else 1.0))
            elif "lm_head" in name:
                p.copy_(noise * 4.0 / p.shape[1] ** 0.5)
            else:   # strong q/k (peaked attention) and strong sublayer outputs (against the residual stream)
                gain = 2.0 if any(k in name for k in ("q_proj", "k_proj", "o_proj", "down_proj")) else 1.0
                p.copy_(noise * gain / p.shape[1] ** 0.5)


def write_checkpoint(family: Family, path: Path, **config_changes) -> Path:
    """config.json, sharded *.safetensors and tokenizer.json of `family`, written by transformers."""
    import transformers
    cfg = getattr(transformers, family.config_class)(**{**family.config, **config_changes})
    torch.manual_seed(family.seed)
    model = getattr(transformers, family.model_class)(cfg).to(torch.float32)
    _randomize(model, family.seed)
    model.save_pretrained(path, max_shard_size="200KB")
    train_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": SPECIALS[0], "add_bos_token": False}))
    return path


def prompt_ids(path: Path) -> list[list[int]]:
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    return [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]


def reference_greedy(path: Path) -> tuple[list[list[int]], float]:
    """transformers' greedy tokens for PROMPTS (fp32, eager attention, one prompt at a time) and the smallest
    gap between the best and second-best logit over every step: a near tie would make the comparison luck."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    outs, min_gap = [], float("inf")
    with torch.inference_mode():
        for ids in prompt_ids(path):
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0,
                                 return_dict_in_generate=True, output_logits=True)
            outs.append(out.sequences[0, len(ids):].tolist())
            for logits in out.logits:
                top2 = logits[0].float().topk(2).values
                min_gap = min(min_gap, float(top2[0] - top2[1]))
    return outs, min_gap


def write_gguf(hf_dir: Path, out: Path, architecture: str, quantize=None) -> Path:
    """The checkpoint in `hf_dir` as an f32 GGUF file, with llama.cpp's tensor and metadata names and its
    tokenizer (a "gpt2" BPE padded to the model's vocabulary, as llama.cpp's converter pads it). `quantize`:
    GGUF tensor name -> the ggml type (gguf.GGMLQuantizationType) it is stored in, quantized by gguf.quants
    (None or a missing name: f32)."""
    import gguf
    import gguf.quants
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    weights = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    leaf = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    w = gguf.GGUFWriter(str(out), arch=architecture)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base((cfg.get("rope_parameters") or cfg)["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim"):            # Qwen3: head_dim apart from hidden_size / num_attention_heads
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = {i: t for t, i in tok["model"]["vocab"].items()}
    specials = {a["id"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([vocab.get(i, f"[PAD{i}]") for i in range(cfg["vocab_size"])])
    w.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL if i in vocab
                       else gguf.TokenType.UNUSED for i in range(cfg["vocab_size"])])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(0)          # <|endoftext|>
    w.add_add_bos_token(False)
    for name, t in weights.items():
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, layer, rest = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{leaf[rest]}.{kind}"
        else:
            gguf_name = f"{top[stem]}.{kind}"
        qtype = (quantize or {}).get(gguf_name)
        if qtype is None:
            w.add_tensor(gguf_name, t.float().numpy())
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(t.float().numpy(), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
