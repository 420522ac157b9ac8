"""The workers' profiler (debug/profiler.py) through its control calls, on the uni executor and on mp at tp=2: every
rank answers; the A/B kinds give paired samples and really turn off what they say on the even steps (the step
history, the collective ledger); "recorder-calls" counts calls that grow with the steps, and its stand-ins publish
nothing; "torch" writes one Chrome trace per rank naming aten ops and the steps; bad arguments are a ValueError."""
import json
from pathlib import Path

import pytest

from devharness import LLM, SamplingParams
from devharness.executor.base import WorkerError
from devharness.protocol.messages import GetCollectives, GetHistory, ProfileResult, StartProfile, StopProfile
from tests.helpers import as_inputs, mixed_prompts


@pytest.fixture(scope="module", params=[("uni", 1), ("mp", 2)], ids=["uni", "mp-tp2"])
def llm(request, tmp_path_factory):
    backend, tp = request.param
    with LLM("tiny-llama", tensor_parallel_size=tp, distributed_executor_backend=backend, threads_per_worker=1,
             num_kv_blocks=64, max_concurrent_batches=1,
             profiler_dir=str(tmp_path_factory.mktemp("profiles") / "traces")) as llm:
        yield llm


def decode(llm, tokens: int) -> None:
    llm.generate(as_inputs(mixed_prompts(2)), SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))


def profiled(llm, kind: str, tokens: int = 8, **kw) -> tuple[list[ProfileResult], list[int]]:
    """Each rank's result, and the engine steps that ran under the profile."""
    first = llm.engine.core.scheduler.step_count + 1
    llm.start_profile(kind, **kw)
    decode(llm, tokens)
    results = llm.stop_profile()
    return results, list(range(first, llm.engine.core.scheduler.step_count + 1))


def test_the_ab_kinds_give_paired_samples_and_turn_off_on_even_steps(llm):
    world = llm.engine.workers.world_size
    results, steps = profiled(llm, "state-ab")
    assert [(r.kind, r.rank, r.steps) for r in results] == [("state-ab", rank, len(steps)) for rank in range(world)]
    for r in results:
        # (off, on) pairs of neighbouring steps, each a step thread's CPU time in us.
        assert len(r.pairs_us) >= len(steps) // 2 - 1 and all(off > 0 and on > 0 for off, on in r.pairs_us)
    # Off means off: the even steps published no record; every step after the profile does again.
    decode(llm, 2)
    after = llm.engine.core.scheduler.step_count
    for history in llm.engine.workers.control(GetHistory()):
        seen = {h.step for h in history}
        assert {s for s in steps if s % 2} <= seen and not {s for s in steps if s % 2 == 0} & seen
        assert after in seen and after - 1 in seen

    results, steps = profiled(llm, "ledger-ab")
    assert [(r.kind, r.rank) for r in results] == [("ledger-ab", rank) for rank in range(world)]
    assert all(len(r.pairs_us) >= len(steps) // 2 - 1 for r in results)
    if world > 1:   # the ledger entered the all-reduces of the odd steps only
        for ledger in llm.engine.workers.control(GetCollectives()):
            entered = {e.step for e in ledger.entries if steps[0] <= e.step <= steps[-1]}
            assert entered and all(s % 2 for s in entered), sorted(entered)


def test_recorder_calls_grow_with_the_steps_and_stand_ins_publish_nothing(llm):
    world = llm.engine.workers.world_size
    short, _ = profiled(llm, "recorder-calls", tokens=3)
    long, steps = profiled(llm, "recorder-calls", tokens=9)
    assert [r.rank for r in long] == list(range(world))
    for a, b in zip(short, long):
        assert b.steps == len(steps) > a.steps
        assert b.calls["begin_step"].calls == b.calls["end_step"].calls == b.steps
        assert b.calls["set_phase"].calls > a.calls["set_phase"].calls > 0
        assert all(c.seconds > 0 for c in b.calls.values() if c.calls)
        if world > 1:   # each all-reduce enters and leaves the collective phase
            assert b.calls["enter"].calls == b.calls["leave"].calls > a.calls["enter"].calls > 0
    stand_ins, steps = profiled(llm, "recorder-calls", tokens=4, stand_ins=True)
    assert all(r.calls["end_step"].calls == r.steps == len(steps) for r in stand_ins)
    for history in llm.engine.workers.control(GetHistory()):   # the stand-ins stood in: no step was recorded
        assert not {h.step for h in history} & set(steps)


@pytest.mark.parametrize("where", ["given", "profiler_dir"])
def test_the_torch_kind_writes_one_chrome_trace_per_rank(llm, tmp_path, where):
    world = llm.engine.workers.world_size
    if where == "given":
        folder = tmp_path / "traces"
        results, steps = profiled(llm, "torch", tokens=3, trace_dir=str(folder))
    else:   # the engine's --profiler-dir
        folder = Path(llm.config.profiler_dir)
        before = set(folder.iterdir()) if folder.exists() else set()
        results, steps = profiled(llm, "torch", tokens=3)
    files = sorted(set(folder.iterdir()) - (before if where == "profiler_dir" else set()))
    assert sorted(r.trace for r in results) == [str(f) for f in files] and len(files) == world
    for rank, r in enumerate(results):
        assert r.rank == rank and f"rank{rank}-" in r.trace and r.steps == len(steps)
        names = {e.get("name") for e in json.loads(open(r.trace).read())["traceEvents"]}
        assert any(n.startswith("aten::") for n in names if n), sorted(n for n in names if n)[:20]
        assert f"devharness step {steps[-1]}" in names


def test_bad_arguments_are_a_value_error_naming_them(llm):
    workers = llm.engine.workers
    for kw, named in ((dict(kind="flame"), "'flame'"), (dict(kind="state-ab", trace_dir="/tmp"), "trace_dir"),
                      (dict(kind="ledger-ab", stand_ins=True), "stand_ins")):
        with pytest.raises(ValueError, match=named):
            llm.start_profile(**kw)
    # Sent as a control call, the worker's ValueError comes back as other control errors do: raised as it is by the
    # in-process worker, a WorkerError naming each rank and the ValueError from a worker process.
    error = ValueError if workers.world_size == 1 else WorkerError
    with pytest.raises(error, match=r"(ValueError: )?profile kind 'flame': must be one of torch, state-ab"):
        workers.control(StartProfile("flame"))
    with pytest.raises(error, match="profile kind 'torch' needs trace_dir"):
        workers.control(StartProfile("torch"))
    with pytest.raises(ValueError, match="no profile is running"):
        llm.stop_profile()
    with pytest.raises(error, match="no profile is running on rank 0"):
        workers.control(StopProfile())
    # One profile at a time; a second start leaves the first running.
    llm.start_profile("recorder-calls")
    with pytest.raises(ValueError, match="'recorder-calls' profile is running"):
        llm.start_profile("state-ab")
    with pytest.raises(error, match="'recorder-calls' profile is running on rank 0"):
        workers.control(StartProfile("state-ab"))
    decode(llm, 2)
    assert [r.kind for r in llm.stop_profile()] == ["recorder-calls"] * workers.world_size
    decode(llm, 2)   # and the engine goes on
