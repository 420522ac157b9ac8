"""tp=2 and pp=2 on two GPUs, nccl between the ranks: the greedy tokens of tp=1 on one GPU."""
import pytest

from tests.gpu.cuda import require_gpus

require_gpus(2)

from devharness import LLM, SamplingParams   # noqa: E402
from tests.helpers import as_inputs, mixed_prompts   # noqa: E402

PROMPTS = as_inputs(mixed_prompts(8))
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, seed=5, ignore_eos=True)


def run(**kw):
    with LLM("tiny-llama", device="cuda", seed=0, **kw) as llm:
        return [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, p)] for p in (GREEDY, SEEDED)]


@pytest.fixture(scope="module")
def reference():
    return run(distributed_executor_backend="uni")


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2, distributed_executor_backend="mp"),
                                    dict(pipeline_parallel_size=2, distributed_executor_backend="mp")],
                         ids=["tp2-mp", "pp2-mp"])
def test_layout_matches_one_gpu(reference, layout):
    assert run(**layout) == reference


def test_tp2_on_ray_matches_one_gpu(reference, ray_instance):
    assert run(tensor_parallel_size=2, distributed_executor_backend="ray") == reference
