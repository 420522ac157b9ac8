"""Faults planted on purpose (ArmFault): at a step's start, or inside the model at a layer's start
through the layer hook the worker installs; each fires once, on the rank it names."""
import pytest

from devharness import LLM, SamplingParams
from devharness.debug.breakpoints import InjectedFault
from devharness.messages import ArmFault, BreakpointSpec

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", distributed_executor_backend="uni", num_kv_blocks=64) as llm:
        yield llm


def test_a_fault_armed_for_a_layer_fires_there_once(llm):
    step = llm.engine.core.scheduler.step_count + 1
    assert llm.engine.workers.control(ArmFault(BreakpointSpec(layer=1))) == [True]   # any step: the next
    with pytest.raises(InjectedFault, match=f"fault injected on rank 0 at step {step}, layer 1$") as info:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], PARAMS)
    # Raised from the model's layer loop, inside the forward, not at the step's start.
    assert any(f.name == "forward" and f.filename.endswith("llama.py") for f in _frames(info.value))
    assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], PARAMS)[0].outputs[0].token_ids) == 4   # once


def test_a_fault_for_another_rank_is_not_kept(llm):
    assert llm.engine.workers.control(ArmFault(BreakpointSpec(rank=1, layer=0))) == [False]
    assert len(llm.generate([{"prompt_token_ids": [4, 5]}], PARAMS)[0].outputs[0].token_ids) == 4


def _frames(exc):
    import traceback
    return traceback.extract_tb(exc.__traceback__)
