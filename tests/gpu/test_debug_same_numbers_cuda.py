"""Debug mode on CUDA runs serving's kernels: `generate` and `generate` under debug mode give the same tokens
and bit-equal logits digests, tiny-llama at tp=1 on one GPU and at tp=2 on two (tests/debug/test_same_numbers.py
on the CPU). On CUDA the fast backend is the library kernels, so no reference run to tell apart."""
import pytest
import torch

from tests.gpu.cuda import require_gpus

require_gpus(1)

from tests.debug.test_same_numbers import check_same_numbers   # noqa: E402
from tests.helpers import as_inputs, mixed_prompts   # noqa: E402

PROMPTS = as_inputs(mixed_prompts(3, seed=7))
LAYOUTS = {
    "tp1-uni": (1, dict(distributed_executor_backend="uni")),
    "tp2-mp": (2, dict(distributed_executor_backend="mp", tensor_parallel_size=2, threads_per_worker=1)),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_debug_mode_on_cuda_gives_serving_tokens_and_bit_equal_logits(tmp_path, name):
    gpus, llm = LAYOUTS[name]
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA devices, torch sees {torch.cuda.device_count()}")
    case = {"model": "tiny-llama", "prompts": PROMPTS, "llm": dict(llm, device="cuda", num_kv_blocks=64)}
    check_same_numbers(tmp_path, case, expect_backend="fast")
