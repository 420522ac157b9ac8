"""The transformers reference for SmolLM2, loaded once per run: dequantizing its GGUF takes half a minute."""
import contextlib
import functools

import pytest
import torch

from devharness.model.smollm2 import smollm2_path

_readers: dict = {}


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses the GGUF file anew for the config, the weights and the tokenizer (its 49152-token
    vocabulary field by field), and builds the same tensor-name map again for every tensor: here it gets the
    same objects from a cache, which saves about 20 s and changes nothing it computes."""
    import gguf
    from devharness.model.gguf_loader import _Reader   # gguf's reader, faster; test_gguf.py holds it to gguf's
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in _readers:
            _readers[key] = _Reader(path, *args, **kwargs)
        return _readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


@pytest.fixture(scope="session")
def smollm2_hf_model():
    import transformers
    path = smollm2_path()
    with _gguf_parsed_once():
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                 dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer():
    import transformers
    path = smollm2_path()
    with _gguf_parsed_once():
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
