"""Read a llama.cpp GGUF file of a supported family (registry.py): its architecture, its weights in
Hugging Face layout, its tokenizer."""
from __future__ import annotations

import functools
import logging
import re
import threading
from pathlib import Path
from typing import Iterator

import gguf
import gguf.quants
import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tqdm import tqdm

from devharness.model.arch import ModelArch, RopeScaling
from devharness.model.layers import QUANTIZED_BLOCK_BYTES, QuantizedWeight
from devharness.model.registry import family_of_gguf
from devharness.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# GGUF leaf name -> Hugging Face module path; the ".weight"/".bias" suffix is carried over.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")

# llama.cpp's token_type values (llama_token_type); only these two become added tokens.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Pre-tokenizer splits keyed by tokenizer.ggml.pre, as llama.cpp (llama-vocab.cpp) defines them.
# The vocabulary's merges were learned on text cut this way; another cut gives other ids.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,), "gpt2": (_GPT2_SPLIT,),
    # Every numeral is its own piece before the GPT-2 split ("smollm" and its siblings).
    **{name: (r"\p{N}", _GPT2_SPLIT) for name in
       ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")},
    **{name: (_LLAMA3_SPLIT,) for name in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx")},
    # Qwen2 and Qwen3: Llama 3's split with every digit on its own.
    "qwen2": (_LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"),),
}


def _byte_spelling() -> dict[int, str]:
    # GPT-2's printable spelling of the 256 bytes: printable Latin-1 stand for themselves, the rest
    # are shifted to code points from U+0100. Byte-level vocabularies are written in these characters.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


_BYTE_SPELLING = _byte_spelling()
_BYTE_ALPHABET = frozenset(_BYTE_SPELLING.values())


class _Reader(gguf.GGUFReader):
    """gguf's reader, parsing the header 4x faster. It reads every value (each of the ~100k tokenizer
    strings) through `_get`, which slices the np.memmap: a memmap slice costs microseconds in
    __array_finalize__, a plain ndarray's a fraction of that. Here `_get` slices a plain view of the same
    mapping, with the dtypes made once. tests/model/test_gguf.py holds its fields and tensors to gguf's own."""

    _dtypes: dict = {}

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        key = (dtype, self.byte_order if override_order is None else override_order)
        dt = self._dtypes.get(key)
        if dt is None:
            dt = self._dtypes[key] = np.dtype(dtype).newbyteorder(key[1])
        return plain[offset:offset + dt.itemsize * int(count)].view(dt)

    def _build_tensors(self, start_offs: int, fields) -> None:
        # gguf's own build fails on a file cut inside a tensor with a reshape error that names no tensor: check
        # each tensor's byte range against the file first (its offset and size as gguf computes them).
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            start = int(start_offs + offset[0])
            end = start + int(np.prod(dims)) * type_size // block
            if end > len(self.data):
                raise _CutShort(f"tensor {bytes(name).decode(errors='replace')} ({qtype.name}, shape "
                                f"{[int(n) for n in dims]}) takes bytes {start}..{end} of the file, which ends at "
                                f"{len(self.data)}: the file is cut short")
        super()._build_tensors(start_offs, fields)


class _CutShort(ValueError):
    """A tensor's data runs past the end of the file."""


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
    # Parsing the header (~100k tokenizer strings) takes a second; arch, weights and tokenizer are read
    # back to back at startup, so keep the (memory-mapped) reader until the file changes.
    return _Reader(path)


def _open(path: Path) -> gguf.GGUFReader:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file")
    stat = path.stat()
    try:
        return _cached_reader(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    except _CutShort as e:
        raise ValueError(f"{path}: {e}") from None
    except Exception as e:  # gguf reports bad magic, truncation and bad types with assorted exceptions
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _value(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _family_reader(path: Path) -> tuple[gguf.GGUFReader, str, type]:
    """(reader, general.architecture, its family class); ValueError naming the file if none reads it."""
    reader = _open(path)
    arch = _value(reader, "general.architecture")
    return reader, arch, family_of_gguf(arch, str(path))


def _eos_ids(reader: gguf.GGUFReader) -> tuple[int, ...]:
    # llama.cpp stops generation on EOT as well as EOS (chat models often end turns with EOT).
    ids = [_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def read_gguf_arch(path: Path) -> ModelArch:
    """The ModelArch a GGUF file describes; ValueError naming the file if it is unreadable or of no known family."""
    reader, name, family = _family_reader(path)
    tensors = {t.name: t for t in reader.tensors}

    def get(key: str, default=None):
        return _value(reader, f"{name}.{key}", default)

    def need(key: str):
        value = get(key)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata key {name}.{key} is missing")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    if "rope_freqs.weight" in tensors:
        # Llama 3.1-style scaling is baked into per-frequency factors; its parameters are not in the file.
        raise ValueError(f"{path}: RoPE frequency factors (rope_freqs.weight, Llama 3.1 scaling) are not supported")
    scaling_type = get("rope.scaling.type")
    linear_factor = get("rope.scaling.factor", get("rope.scale_linear"))
    scaling = None
    if scaling_type == "linear" or (scaling_type is None and linear_factor not in (None, 1.0)):
        scaling = RopeScaling(rope_type="linear", factor=float(linear_factor))
    elif scaling_type not in (None, "none"):
        raise ValueError(f"{path}: RoPE scaling type {scaling_type!r} is not supported (supported: linear)")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    # token_embd is stored [hidden, vocab] in GGUF order (innermost first).
    vocab_size = len(tokens.data) if tokens is not None else int(tensors["token_embd.weight"].shape[-1])
    bos = _value(reader, "tokenizer.ggml.bos_token_id")
    return ModelArch(
        vocab_size=vocab_size, hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")), num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=int(bos) if bos is not None else None, eos_token_ids=_eos_ids(reader),
        architecture=family.__name__, qkv_bias="blk.0.attn_q.bias" in tensors,
        o_proj_bias="blk.0.attn_output.bias" in tensors, mlp_bias="blk.0.ffn_up.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors, sliding_window=get("attention.sliding_window"))


def _hf_name(path: Path, gguf_name: str) -> tuple[str, int | None]:
    """(Hugging Face name, layer index or None for tensors outside the decoder layers)."""
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        layer = int(m.group(1))
        return f"model.layers.{layer}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}", layer
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}", None
    raise ValueError(f"{path}: tensor {gguf_name!r} has no place in the decoder")


def _unpermute_rotary(t: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp's converter reorders each head's q/k rows from HF's rotate-half layout (first half,
    # second half) to interleaved pairs; invert its reshape(n_head, 2, d/2).swapaxes(1, 2).
    half = t.shape[0] // n_head // 2
    return t.reshape(n_head, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def iter_gguf_weights(path: Path, dtype: torch.dtype, layer_range: tuple[int, int] | None = None,
                      quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, dequantized tensor in `dtype`) for every tensor in the file; with `quantized`,
    a matrix in Q4_1 or Q8_0 comes as it is stored, a QuantizedWeight of its blocks (other quantized types are
    dequantized, named in one log line).

    `layer_range` (start, end), end exclusive, keeps only those decoder layers; tensors of other layers
    are skipped before dequantization. Tensors outside the layers (embeddings, final norm, lm_head)
    are always yielded: the caller keeps what its pipeline stage needs. lm_head is absent when tied.
    """
    path = Path(path)
    arch = read_gguf_arch(path)
    reader, _, family = _family_reader(path)
    if layer_range is not None:
        start, end = layer_range
        if not 0 <= start < end <= arch.num_hidden_layers:
            raise ValueError(f"layer_range {layer_range} is outside 0..{arch.num_hidden_layers} "
                             f"layers of {path}; pass (start, end) with start < end")
    selected = []
    for tensor in reader.tensors:
        name, layer = _hf_name(path, tensor.name)
        if layer is None or layer_range is None or start <= layer < end:
            selected.append((name, tensor))
    # The checks above run at the call, not at the first next(): a bad range fails where it is passed.
    for _, tensor in selected:
        _check_size(path, tensor)
    if quantized:
        other = sorted({t.tensor_type.name for _, t in selected if t.tensor_type not in _PLAIN
                        and int(t.tensor_type) not in QUANTIZED_BLOCK_BYTES})
        if other:
            logger.info("%s: %s tensors are dequantized to %s (the kernels compute with Q4_1 and Q8_0 blocks)",
                        path.name, ", ".join(other), str(dtype).removeprefix("torch."))
    return _dequantize_each(path, selected, arch, dtype, family.gguf_rope_permuted, quantized)


_PLAIN = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


def has_quantized_tensors(path: Path) -> bool:
    """Whether the file stores any tensor in a quantized type (else its weights are float as stored)."""
    return any(t.tensor_type not in _PLAIN for t in _open(Path(path)).tensors)


def _check_size(path: Path, tensor) -> None:
    """A tensor whose stored bytes are fewer than its shape and type take (a file cut short, a block cut off) is
    an error naming it, before anything is read."""
    block, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    count = int(np.prod(tensor.shape))
    need = count // block * type_size
    if count % block or tensor.data.nbytes < need:
        raise ValueError(f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}, shape "
                         f"{[int(n) for n in tensor.shape]}) needs {need} bytes of whole {block}-weight blocks; "
                         f"the file holds {tensor.data.nbytes}")


def _dequantize_each(path: Path, selected: list, arch: ModelArch, dtype: torch.dtype,
                     permuted: bool, quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    # Only "llama" files had their q/k rows permuted by llama.cpp's converter; qwen2/qwen3 keep HF's order.
    heads = {"self_attn.q_proj": arch.num_attention_heads,
             "self_attn.k_proj": arch.num_key_value_heads} if permuted else {}
    # tqdm's default lock holds a multiprocessing RLock: a named semaphore, which a worker process that ends
    # without running finalizers never unlinks, and which the resource tracker then reports as leaked when
    # the driver exits ("3 leaked semaphore objects" after a tp=3 run). One process needs a thread lock.
    if getattr(tqdm, "_lock", None) is None:
        tqdm.set_lock(threading.RLock())
    # disable=None shows the bar only when stderr is a terminal, so logs stay clean.
    for name, tensor in tqdm(selected, desc=f"dequantizing {path.name}", unit="tensor", leave=False,
                             disable=None):
        n_head = next((n for part, n in heads.items() if f".{part}." in name), None)
        if quantized and int(tensor.tensor_type) in QUANTIZED_BLOCK_BYTES and len(tensor.shape) == 2:
            blocks = torch.from_numpy(np.array(tensor.data))   # own the memory: the map is read-only
            if n_head is not None:   # whole rows move: the blocks follow them
                blocks = _unpermute_rotary(blocks, n_head)
            yield name, QuantizedWeight(blocks.contiguous(), int(tensor.tensor_type), tensor.name)
            continue
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if not array.flags.writeable:
            # Unquantized tensors come back as views of the read-only memory map; own the memory.
            array = np.array(array)
        weight = torch.from_numpy(array)
        if n_head is not None:
            weight = _unpermute_rotary(weight, n_head)
        yield name, weight.to(dtype)


def _pre_tokenizer(path: Path, pre: str | None):
    splits = _PRE_SPLITS.get(pre or "default")
    if splits is None:
        logger.warning("%s: unknown tokenizer.ggml.pre %r; using GPT-2 pre-tokenization, which may "
                       "tokenize some text differently from llama.cpp", path, pre)
        splits = _PRE_SPLITS["default"]
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def load_gguf_tokenizer(path: Path) -> Tokenizer:
    """The byte-level BPE tokenizer, chat template and special ids stored in a GGUF file's metadata."""
    path = Path(path)
    reader, _, _ = _family_reader(path)
    kind = _value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model {kind!r} is not supported; devharness builds "
                         "byte-level BPE ('gpt2') tokenizers from GGUF files")
    tokens: list[str] = _value(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = _value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _value(reader, "tokenizer.ggml.merges", [])]
    # The BPE model only knows byte-level spellings; a token written otherwise is respelled from its bytes.
    vocab = {}
    for i, token in enumerate(tokens):
        spelled = token if set(token) <= _BYTE_ALPHABET else "".join(
            _BYTE_SPELLING[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, i)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(path, _value(reader, "tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) must match whole, never be cut into bytes. One spelled outside the
    # byte alphabet was respelled above, so adding its raw text would mint a new id: skip it.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ttype in zip(tokens, token_types)
                            if ttype == _TOKEN_CONTROL and set(t) <= _BYTE_ALPHABET])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ttype in zip(tokens, token_types)
                    if ttype == _TOKEN_USER_DEFINED and t in vocab])
    if len(vocab) != len(tokens):
        logger.warning("%s: %d of %d tokens repeat an earlier spelling; their ids never come out of encode",
                       path, len(tokens) - len(vocab), len(tokens))
    bos = _value(reader, "tokenizer.ggml.bos_token_id")
    eos_ids = _eos_ids(reader)
    return Tokenizer(
        tok, bos_token_id=int(bos) if bos is not None else None, eos_token_ids=eos_ids,
        chat_template=_value(reader, "tokenizer.chat_template"),
        add_bos=bool(_value(reader, "tokenizer.ggml.add_bos_token", False)),
        bos_token=tokens[bos] if bos is not None else None,
        eos_token=tokens[eos_ids[0]] if eos_ids else None)

