"""Two engines in one process (the uni executor): each worker's debug machinery (its model's hooks, its breakpoints,
its capture, its planted fault, its state recorder) lives on that worker's own objects, so what is armed or planted
on one never reaches the other."""
from devharness import LLM, SamplingParams
from devharness.debug.breakpoints import LayerWatch
from devharness.debug.state import StateReader
from devharness.protocol.messages import ArmBreakpoint, ArmCapture, BreakpointSpec, ClearBreakpoints, TakeCapture

PARAMS = SamplingParams(max_tokens=8, temperature=0.0)
PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}, {"prompt_token_ids": [11, 12, 13]}]


def tiny(**kwargs) -> LLM:
    return LLM("tiny-llama", distributed_executor_backend="uni", num_kv_blocks=64, enable_prefix_caching=False,
               **kwargs)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def steps_seen(llm: LLM) -> tuple[int, list[int]]:
    """(the step its worker's state file says, the steps its history file holds)."""
    reader = StateReader(llm.engine.config.run_id, 0)
    try:
        return reader.state().step, [r.step for r in reader.history()]
    finally:
        reader.close()


def test_what_is_armed_on_one_engine_leaves_the_other_untouched():
    with tiny() as clean:
        want = tokens(clean)
    with tiny(inject="kv-corrupt:layer=1:rank=0") as a, tiny() as b:
        wa, wb = a.engine.workers.worker, b.engine.workers.worker
        assert wa.planted is not None and wb.planted is None
        # On a: a capture and a layer breakpoint for step 1, which b's step 1 reaches first (it must not take it).
        assert a.engine.workers.control(ArmCapture()) == [None]
        assert a.engine.workers.control(ArmBreakpoint(BreakpointSpec(step=1, layer=1))) == [True]
        a_state = steps_seen(a)
        assert b.engine.workers.control(ArmBreakpoint(BreakpointSpec(step=10**6))) == [True]   # b's own, kept

        assert tokens(b) == want                                        # no fault, no capture, no pause
        assert [type(h) for h in wb.runner.model.hooks.installed] == [LayerWatch]   # none of a's hooks
        assert wb.runner.head_watchers == () and len(wa.runner.head_watchers) == 1   # a's logits watcher, a's own
        assert wb.runner.model.hooks is not wa.runner.model.hooks
        assert wb.runner.kernels.write_kv is not wa.runner.kernels.write_kv   # a's fault wraps a's op only
        b_step, b_history = steps_seen(b)
        assert b_step >= len(want[0]) and b_history == list(range(1, b_step + 1))   # b's steps, in b's files
        assert steps_seen(a) == a_state                                 # a's files saw none of them

        # a's breakpoint is still armed (b's layer loop did not take it), and only a's capture kept anything.
        assert a.engine.workers.control(ClearBreakpoints()) == [1]
        assert b.engine.workers.control(ClearBreakpoints()) == [1]
        assert a.engine.workers.control(TakeCapture()) == [[]]
        assert a.engine.workers.control(ArmCapture()) == [None]
        got = tokens(a)
        assert got != want                                              # a's planted fault ran in a
        assert a.engine.workers.control(TakeCapture())[0]               # a's capture saw a's forwards
        a_step, a_history = steps_seen(a)
        assert a_history == list(range(1, a_step + 1)) and steps_seen(b) == (b_step, b_history)
        assert tokens(b) == want                                        # and b still runs clean
        assert [type(h) for h in wa.runner.model.hooks.installed] == [LayerWatch]   # the capture left a's model
        assert wa.runner.head_watchers == ()                                           # and a's runner


def test_a_profile_on_one_engine_leaves_the_other_untouched():
    """A "recorder-calls" profile (debug/profiler.py: the state recorder's methods counted and timed) on one engine's
    worker counts that worker's calls alone: the other engine's recorder keeps its plain methods, and its steps, run
    while the profile runs, are not counted."""
    from devharness.debug.state import StateRecorder
    with tiny() as a, tiny() as b:
        ra, rb = a.engine.workers.worker.recorder, b.engine.workers.worker.recorder
        a.start_profile("recorder-calls")
        assert type(ra) is not StateRecorder and type(rb) is StateRecorder
        b_tokens = tokens(b)                                            # b's steps, while a profiles
        assert tokens(a) == b_tokens                                    # the same model and prompts
        [result] = a.stop_profile()
        assert result.kind == "recorder-calls" and result.steps >= len(b_tokens[0])
        assert result.calls["end_step"].calls == result.calls["begin_step"].calls == result.steps   # a's steps only
        assert type(ra) is StateRecorder and type(rb) is StateRecorder   # stop put a's back
        assert tokens(b) == b_tokens
