"""The transformers reference for SmolLM2, loaded once per run: dequantizing its GGUF takes half a minute."""
import pytest
import torch

from devharness.model.smollm2 import smollm2_path


@pytest.fixture(scope="session")
def smollm2_hf_model():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    path = smollm2_path()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
