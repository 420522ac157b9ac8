"""LLMEngine's public accessors for a caller that steps the engine itself (the benches among them): the unfinished
requests' ids and aborting them all, a copy of the scheduler's state, the flight recorder, and the in-process
worker's model (Executor.model_in_process)."""
import pytest
import torch

from devharness import LLM, SamplingParams

LONG = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", distributed_executor_backend="uni", threads_per_worker=1) as llm:
        yield llm


def test_unfinished_request_ids_and_abort_all(llm):
    engine = llm.engine
    assert engine.unfinished_request_ids() == []
    ids = [engine.add_request({"prompt_token_ids": [5, 6, 7 + i]}, LONG, f"r{i}") for i in range(3)]
    short = engine.add_request({"prompt_token_ids": [9, 9]}, SamplingParams(max_tokens=1, temperature=0), "short")
    assert engine.unfinished_request_ids() == ids + [short]
    engine.abort_request("r1")
    engine.step()                      # "short" finishes with its one token
    assert engine.unfinished_request_ids() == ["r0", "r2"]
    assert engine.stats()["kv_blocks_used"] > 0
    assert engine.abort_all_requests() == ["r0", "r2"]
    assert engine.unfinished_request_ids() == [] and not engine.has_unfinished_requests()
    assert engine.stats()["kv_blocks_used"] == 0
    assert engine.abort_all_requests() == []


def test_scheduler_snapshot_follows_the_steps(llm):
    engine = llm.engine
    first = engine.scheduler_snapshot()
    assert first.step == engine.stats()["step"] and first.running == first.waiting == ()
    engine.add_request({"prompt_token_ids": list(range(10, 30))}, LONG, "a")
    engine.add_request({"prompt_token_ids": list(range(40, 45))}, LONG, "b")
    waiting = engine.scheduler_snapshot()
    assert [r.request_id for r in waiting.waiting] == ["a", "b"] and waiting.num_waiting == 2
    assert waiting.num_running == 0 and not waiting.all_decoding
    assert [(r.num_tokens, r.num_computed_tokens, r.num_output_tokens) for r in waiting.waiting] == [(20, 0, 0),
                                                                                                      (5, 0, 0)]
    engine.step()
    snap = engine.scheduler_snapshot()
    assert snap.step == first.step + 1 and snap.num_waiting == 0
    # Both prompts ran whole: each request holds its prompt and one sampled token, which its next step computes.
    assert [(r.request_id, r.num_tokens, r.num_computed_tokens, r.num_output_tokens) for r in snap.running] == \
        [("a", 21, 20, 1), ("b", 6, 5, 1)]
    assert snap.all_decoding
    engine.step()
    after = engine.scheduler_snapshot()
    assert after.step == snap.step + 1 and [r.num_output_tokens for r in after.running] == [2, 2]
    assert snap.running[0].num_tokens == 21   # a copy: the step did not change it
    engine.abort_all_requests()


def test_flight_recorder_holds_the_last_steps(llm):
    engine = llm.engine
    flight = engine.flight_recorder
    assert flight is not None and flight.capacity == llm.config.flight_steps == 64
    llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    _, steps, _ = flight.window()
    assert steps[-1].scheduler_output.step == engine.scheduler_snapshot().step


def test_model_in_process_takes_a_forward_hook(llm):
    model = llm.engine.workers.model_in_process()
    assert isinstance(model, torch.nn.Module)
    seen = []
    hook = model.register_forward_pre_hook(lambda module, args: seen.append(len(args[0])))
    try:
        llm.generate([{"prompt_token_ids": [3, 4, 5, 6]}], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    finally:
        hook.remove()
    assert seen == [4, 1]   # the prompt's four rows, then one decode row


def test_no_flight_recorder_when_flight_steps_is_0():
    with LLM("tiny-llama", distributed_executor_backend="uni", threads_per_worker=1, flight_steps=0) as llm:
        assert llm.engine.flight_recorder is None
