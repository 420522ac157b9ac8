"""Batches in flight (max_concurrent_batches, vLLM's batch queue): the scheduler never puts a request in two
batches at once; at pp=2 with two batches in flight (mp) the tokens are pp=1's (greedy and seeded, with
preemption), stage 0 starts step i+1 before stage 1 ends step i, the recording replays one step at a time to
the same tokens, and step_once advances exactly one batch."""
import asyncio

import pytest

from devharness import LLM, SamplingParams
from devharness.config import ParallelConfig, SchedulerConfig
from devharness.engine.async_llm import AsyncLLM
from devharness.engine.record import FlightRecorder
from devharness.protocol.recording import RecordedStep
from devharness.engine.replay import replay
from devharness.engine.request import Request
from devharness.engine.scheduler import Scheduler
from devharness.protocol.messages import GetHistory, InjectFault, ModelRunnerOutput, SchedulerOutput
from tests.helpers import as_inputs, mixed_prompts

pytestmark = pytest.mark.timeout(300)

PROMPTS = as_inputs(mixed_prompts(8))
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=10, temperature=0.8, seed=40 + i, ignore_eos=True) for i in range(len(PROMPTS))]
KV_BLOCKS = 10   # the 8 requests need ~15 blocks at once: requests get preempted and recomputed


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_default_is_the_pp_size_and_bad_values_are_named():
    assert ParallelConfig(pipeline_parallel_size=3).batches_in_flight == 3
    assert ParallelConfig(pipeline_parallel_size=3, max_concurrent_batches=1).batches_in_flight == 1
    with pytest.raises(ValueError, match=r"ParallelConfig.max_concurrent_batches=0: must be an integer >= 1"):
        ParallelConfig(max_concurrent_batches=0)


# -- the scheduler alone ---------------------------------------------------------------------------

def test_a_request_in_flight_is_not_scheduled_again():
    sched = Scheduler(SchedulerConfig(num_kv_blocks=64), 64, max_concurrent_batches=2)
    for i in range(4):
        sched.add_request(Request(f"r{i}", [1, 2, 3], GREEDY, 0, (), 64))
    first, second = sched.schedule(), sched.schedule()
    # Each batch takes half of the requests, the second none of the first's.
    assert list(first.num_scheduled_tokens) == ["r0", "r1"] and list(second.num_scheduled_tokens) == ["r2", "r3"]
    assert not sched.schedule().num_scheduled_tokens   # all four in flight
    sched.update_from_output(first, ModelRunnerOutput(["r0", "r1"], [5, 6]))
    third = sched.schedule()
    assert list(third.num_scheduled_tokens) == ["r0", "r1"]
    assert [c.new_token_ids for c in third.cached_requests] == [[5], [6]]


def test_preemption_spares_requests_in_flight():
    sched = Scheduler(SchedulerConfig(num_kv_blocks=2, block_size=4), 2, max_concurrent_batches=2)
    for i in range(2):
        sched.add_request(Request(f"r{i}", [1, 2, 3, 4], GREEDY, 0, (), 8))
    first, second = sched.schedule(), sched.schedule()   # one block each: the cache is full
    sched.update_from_output(first, ModelRunnerOutput(["r0"], [9]))
    # r0 needs a second block; r1, the most recent, is in flight, so r0 gives way itself.
    assert not sched.schedule().num_scheduled_tokens
    assert [r.req_id for r in sched.running] == ["r1"] and sched.num_preemptions == 1
    sched.update_from_output(second, ModelRunnerOutput(["r1"], [9]))
    assert list(sched.schedule().num_scheduled_tokens) == ["r1"]


def test_flight_recorder_keeps_every_step_in_flight():
    flight = FlightRecorder(capacity=8)
    a, b = (SchedulerOutput(step, [], [], {"r": 1}, []) for step in (1, 2))
    flight.begin(a)
    flight.begin(b)
    _, steps, _ = flight.window()
    assert [(s.scheduler_output.step, s.error_kind) for s in steps] == [(1, "unfinished"), (2, "unfinished")]
    assert all(s.error == "still running when the bundle was written" for s in steps)
    flight.end(RecordedStep(a, ["r"], [7]))
    _, steps, _ = flight.window()
    assert [(s.scheduler_output.step, s.error, s.error_kind) for s in steps][0] == (1, None, None) and \
        steps[1].error_kind == "unfinished"


# -- pp=2 on mp, two batches in flight ----------------------------------------------------------------

@pytest.fixture(scope="module")
def reference():
    with LLM("tiny-llama", distributed_executor_backend="uni", threads_per_worker=1, num_kv_blocks=256) as llm:
        return {"greedy": tokens(llm.generate(PROMPTS, GREEDY)), "seeded": tokens(llm.generate(PROMPTS, SEEDED))}


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    record_dir = tmp_path_factory.mktemp("in-flight") / "rec"
    with LLM("tiny-llama", pipeline_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
             num_kv_blocks=KV_BLOCKS, max_concurrent_batches=2, record_dir=str(record_dir)) as llm:
        assert llm.engine.core.max_concurrent_batches == 2
        yield llm, record_dir


def test_tokens_match_pp1_with_preemption(pp2, reference):
    llm, _ = pp2
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference["greedy"]
    assert tokens(llm.generate(PROMPTS, SEEDED)) == reference["seeded"]
    assert llm.stats()["num_preemptions"] > 0


def test_stage_0_starts_the_next_step_before_stage_1_ends_this_one(pp2):
    llm, _ = pp2
    llm.generate(PROMPTS, GREEDY)
    stage0, stage1 = ({r.step: r for r in history} for history in llm.engine.workers.control(GetHistory()))
    pairs = [(stage0[s + 1], stage1[s]) for s in stage1 if s + 1 in stage0]
    assert len(pairs) > 10
    overlapping = [b.step for a, b in pairs if a.started_at < b.ended_at]
    assert overlapping, "no step of stage 0 began before stage 1 ended the step before it"


def test_recording_replays_one_step_at_a_time(pp2):
    llm, record_dir = pp2
    llm.generate(PROMPTS, SEEDED)
    result = replay(record_dir, 1, 1, "uni", threads_per_worker=1)
    assert result.ok and result.num_steps == result.total_steps > 0, result.verdict()


def test_no_model_in_this_process_on_mp(pp2):
    llm, _ = pp2
    with pytest.raises(ValueError, match="the mp executor's workers run in processes of their own"):
        llm.engine.workers.model_in_process()


def test_step_once_advances_one_batch(pp2):
    """Last in this module: the AsyncLLM takes the engine over and shuts it down."""
    llm, _ = pp2

    async def main():
        front = AsyncLLM(llm.engine, llm.runner)
        try:
            long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            streams = [front.add_request(p, long, f"s{i}") for i, p in enumerate(PROMPTS[:4])]
            while front.stats()["num_generated_tokens_total"] < 8:
                await asyncio.sleep(0.01)
            paused = await front.pause()
            assert paused["batches_in_flight"] == 0 and paused["state"] == "paused"
            for _ in range(2):
                before = front.stats()
                after = await front.step_once(1)
                assert after["step"] == before["step"] + 1 and after["batches_in_flight"] == 0
                assert 0 < after["num_generated_tokens_total"] - before["num_generated_tokens_total"] <= 2
            await front.resume()
            for s in streams:
                s.abort()
        finally:
            front.shutdown()

    asyncio.run(main())


def test_an_uneven_layer_partition_gives_the_same_tokens(reference):
    """pp_layer_partition=[3, 1]: stage 0 runs layers 0..2, stage 1 layer 3 and the LM head; the tokens are
    pp=1's with batches in flight."""
    with LLM("tiny-llama", pipeline_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
             num_kv_blocks=KV_BLOCKS, pp_layer_partition=[3, 1]) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == reference["greedy"]
        # Layer 2 is stage 0's (an even split would give it to stage 1): a fault planted there on rank 0 fires.
        assert llm.engine.workers.control(InjectFault("kv-corrupt:layer=2:rank=0")) == [True, False]
        assert tokens(llm.generate(PROMPTS, GREEDY)) != reference["greedy"]


def test_a_partition_that_does_not_fit_is_named():
    with pytest.raises(ValueError, match=r"pp_layer_partition 3,2 gives 5 layers; the model has 4"):
        LLM("tiny-llama", pipeline_parallel_size=2, distributed_executor_backend="mp", pp_layer_partition=[3, 2])
    with pytest.raises(ValueError, match=r"ParallelConfig.pp_layer_partition=\[4\]: must be 2 layer counts >= 1"):
        ParallelConfig(pipeline_parallel_size=2, pp_layer_partition=[4])
