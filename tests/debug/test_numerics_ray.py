"""The numerics check on Ray actors (tp=2 x pp=2): a nan planted on a first-stage rank is named on that rank, not on
its tp peer (which saw it after the all-reduce) nor on the second stage; the other request goes on. Ray workers
answer a step on the output rank only: the driver reads the other ranks' records with GetNumerics."""
import re

import pytest

from devharness import LLM
from devharness.protocol.errors import NonFiniteError
from devharness.protocol.messages import InjectFault
from tests.debug.test_numerics import ENGINE, PARAMS, PROMPTS, born, tokens


@pytest.fixture(scope="module")
def ray_llm(ray_instance):
    with LLM(**ENGINE, tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="ray") as llm:
        yield llm, tokens(llm.generate(PROMPTS, PARAMS))


@pytest.mark.parametrize("spec, rank, layer, site", [("nan:layer=0:rank=1", 1, 0, "attention.partial"),
                                                     ("inf:layer=3:rank=2:site=mlp.partial", 2, 3, "mlp.partial")])
def test_ray_names_the_rank_it_was_born_on(ray_llm, spec, rank, layer, site):
    llm, clean = ray_llm
    assert sum(llm.engine.workers.control(InjectFault(spec))) == 1
    try:
        with pytest.raises(NonFiniteError) as info:
            llm.generate(PROMPTS, PARAMS)
    finally:
        llm.engine.workers.control(InjectFault(None))
    first, second = info.value.outputs
    assert re.fullmatch(born(spec, "ray", rank, layer, site), first.outputs[0].error), first.outputs[0].error
    assert second.outputs[0].token_ids == clean[1]
    assert tokens(llm.generate(PROMPTS, PARAMS)) == clean
