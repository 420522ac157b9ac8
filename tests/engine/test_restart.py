"""LLM(restart_workers=True): a step that fails (a planted raise) fails that generate call, and the engine
restarts its workers inside it: every request's KV blocks and the prefix cache are forgotten, and the next call
gives tp=1's tokens on the fresh workers (a prefix hit on the old cache would read a KV cache the new workers
never wrote). The old workers are gone for good: the in-process one is collected, although start-up froze every
object then made (gc.freeze) out of the collector's reach."""
import gc
import weakref

import pytest

from devharness import LLM, SamplingParams
from tests.helpers import as_inputs, mixed_prompts

PROMPTS = as_inputs(mixed_prompts(6, lengths=(40, 33, 70)))
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_a_failed_step_restarts_the_workers_and_forgets_the_kv_cache():
    with LLM("tiny-llama", threads_per_worker=1, num_kv_blocks=64) as llm:
        expected = tokens(llm.generate(PROMPTS, GREEDY))
        steps = llm.stats()["step"]
    with LLM("tiny-llama", threads_per_worker=1, num_kv_blocks=64, restart_workers=True,
             inject=f"raise:step={steps + 2}:rank=0") as llm:
        assert gc.get_freeze_count() > 0   # start-up froze what it made
        assert tokens(llm.generate(PROMPTS, GREEDY)) == expected   # fills the prefix cache
        worker = llm.engine.workers.worker
        worker.itself = worker   # a reference cycle: only a collection frees it, and start-up froze it
        old, worker = weakref.ref(worker), None
        with pytest.raises(Exception, match="fault|raise|inject"):
            llm.generate(PROMPTS, GREEDY)
        stats = llm.stats()
        assert (stats["num_running"], stats["num_waiting"], stats["kv_blocks_used"]) == (0, 0, 0)
        assert llm.engine.workers.worker is not None
        gc.collect()
        assert old() is None   # a new worker, and the old one given back to the collector, cycle and all
        hits = stats["prefix_cache_hit_tokens"]
        assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
        assert llm.stats()["prefix_cache_hit_tokens"] == hits   # nothing cached before the restart was used
    assert gc.get_freeze_count() == 0   # shut down: nothing of it stays out of the collector's reach
