"""mp executor: every tp x pp layout gives uni's tokens; a killed worker is an error naming its rank;
nothing (process, shared-memory segment) outlives the executor, even without shutdown()."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgspec
import pytest

from devharness import LLM, SamplingParams
from devharness.executor.base import WorkerDied, WorkerError
from devharness.distributed import message_queue
from devharness.distributed.shm_ring import SHM_PREFIX
from devharness.protocol.messages import ArmRequestFault, Ping
from tests.helpers import as_inputs, frozen_at_startup, mixed_prompts, pid_alive, stop_process

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
PROMPTS = as_inputs(mixed_prompts(16))
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Longer outputs need ~72 blocks at once where KV_BLOCKS holds 48: requests get preempted and recomputed.
GREEDY_LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SEEDED = [SamplingParams(max_tokens=12, temperature=0.8, seed=100 + i, ignore_eos=True) for i in range(len(PROMPTS))]
KV_BLOCKS = 48   # enough for PROMPTS with GREEDY (~45 blocks), not with GREEDY_LONG
# Step messages larger than the step ring: the ring is made small here (SMALL_RING: 4 slots of 512 bytes, where a run
# has 8 of 256 KiB), and a request biased on every token of tiny-llama's vocabulary takes 3 KB of its step message.
SMALL_RING = (512, 4)
BIG_MESSAGE = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                             logit_bias={t: ((t * 37) % 101) / 1000 - 0.05 for t in range(264)})
FEW_PROMPTS = PROMPTS[:4]
# Answers larger than a pipe holds (64 KiB): 100 prompt tokens' top-20 logprobs each, beside requests whose step
# messages are larger than the ring.
LONG_PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 250 + 3 for j in range(100)]} for i in range(4)]
BIG_ANSWERS = ([SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=20)] * len(LONG_PROMPTS)
               + [msgspec.structs.replace(BIG_MESSAGE, max_tokens=2)] * 2)
LAYOUTS = [(2, 1), (1, 2), (2, 2)]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def my_segments(pid: int | None = None) -> set[str]:
    """Segments created by a process (ShmBroadcast names carry the creator's pid)."""
    prefix = f"{SHM_PREFIX}{pid or os.getpid()}_"
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def mp_llm(tp: int, pp: int, **kwargs) -> LLM:
    return LLM("tiny-llama", tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="mp",
               threads_per_worker=1, **kwargs)


@pytest.fixture(scope="module")
def reference():
    with LLM("tiny-llama", distributed_executor_backend="uni", threads_per_worker=1, num_kv_blocks=256) as llm:
        return {"greedy": tokens(llm.generate(PROMPTS, GREEDY)),
                "long": tokens(llm.generate(PROMPTS, GREEDY_LONG)),
                "seeded": tokens(llm.generate(PROMPTS, SEEDED)),
                "big_message": tokens(llm.generate(FEW_PROMPTS, BIG_MESSAGE)),
                "big_answers": tokens(llm.generate(LONG_PROMPTS + FEW_PROMPTS[:2], BIG_ANSWERS))}


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda tp_pp: f"tp{tp_pp[0]}-pp{tp_pp[1]}")
def layout_llm(request):
    # One executor per layout serves all its checks: starting workers is the slow part here. Its step ring is small,
    # so that the step message of a few requests is larger than the ring.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(message_queue, "RING_SLOT_BYTES", SMALL_RING[0])
        mp.setattr(message_queue, "RING_SLOTS", SMALL_RING[1])
        llm = mp_llm(*request.param, num_kv_blocks=KV_BLOCKS)
    with llm:
        yield llm


def test_greedy_matches_uni(layout_llm, reference):
    before = layout_llm.stats()["num_preemptions"]
    assert tokens(layout_llm.generate(PROMPTS, GREEDY)) == reference["greedy"]
    assert layout_llm.stats()["num_preemptions"] == before, "this check is meant to run without preemption"


def test_greedy_with_preemption_matches_uni(layout_llm, reference):
    before = layout_llm.stats()["num_preemptions"]
    assert tokens(layout_llm.generate(PROMPTS, GREEDY_LONG)) == reference["long"]
    assert layout_llm.stats()["num_preemptions"] > before


def test_seeded_sampling_matches_uni(layout_llm, reference):
    assert tokens(layout_llm.generate(PROMPTS, SEEDED)) == reference["seeded"]


def test_step_message_larger_than_the_ring_waits_for_a_paused_worker(layout_llm, reference):
    """A rank that reads nothing for longer than the driver's write timeout (paused, as in a debugger) while a
    step message larger than the ring is half written: the write waits for it, and the channel goes on."""
    ring = layout_llm.engine.core.executor._workers.queue.ring.handle()
    assert (ring.slot_bytes, ring.num_slots) == SMALL_RING
    assert len(msgspec.msgpack.encode(BIG_MESSAGE)) > ring.slot_bytes * ring.num_slots
    pid = layout_llm.engine.core.executor.worker_pids[-1]
    stop_process(pid)
    resume = threading.Timer(2.5, os.kill, (pid, signal.SIGCONT))
    resume.start()
    try:
        assert tokens(layout_llm.generate(FEW_PROMPTS, BIG_MESSAGE)) == reference["big_message"]
    finally:
        resume.cancel()
        os.kill(pid, signal.SIGCONT)
    assert tokens(layout_llm.generate(PROMPTS, GREEDY)) == reference["greedy"]


def test_large_answers_and_large_step_messages_in_flight_together(layout_llm, reference):
    """At pp=2 the last stage may be sending an answer larger than its pipe holds while the driver writes the
    next step, larger than the ring: the driver reads answers while it waits, or each waits for the other."""
    outs = layout_llm.generate(LONG_PROMPTS + FEW_PROMPTS[:2], BIG_ANSWERS)
    assert tokens(outs) == reference["big_answers"]
    assert [len(o.prompt_logprobs) for o in outs[:len(LONG_PROMPTS)]] == [100] * len(LONG_PROMPTS)


def test_control_calls_answer_from_each_rank(layout_llm):
    workers = layout_llm.engine.workers
    assert workers.control(Ping()) == list(range(workers.world_size))
    assert workers.control(Ping(), ranks=[workers.world_size - 1]) == [workers.world_size - 1]
    with pytest.raises(ValueError, match="not a control call"):
        workers.control("__del__")
    # A call that raises on every rank names each one, and leaves the workers usable.
    with pytest.raises(WorkerError, match=r"(?s)rank 0 \(tp 0, pp 0, pid \d+\) failed in arm_request_fault: "
                                          r"ValueError.*rank 1 "):
        workers.control(ArmRequestFault("r1", where="nowhere"))
    assert workers.control(Ping()) == list(range(workers.world_size))


def test_each_worker_freezes_what_its_start_up_made(layout_llm):
    # Full collections then pass by torch's and the model's objects instead of holding a step for ~100 ms.
    run_id = layout_llm.engine.config.run_id
    assert all(frozen_at_startup(run_id, rank) > 10_000 for rank in range(layout_llm.engine.workers.world_size))


def test_killed_worker_is_named_and_nothing_is_left():
    segments_before = my_segments()
    llm = mp_llm(2, 1, num_kv_blocks=1024)
    pids = llm.engine.core.executor.worker_pids
    killed_at = []

    def kill_rank_1():
        killed_at.append(time.monotonic())
        os.kill(pids[1], signal.SIGKILL)

    # Long enough that the kill lands mid-generation on any machine.
    timer = threading.Timer(0.5, kill_rank_1)
    timer.start()
    try:
        with pytest.raises(WorkerDied, match=r"rank 1 \(tp 1, pp 0, pid \d+\) died \(killed by SIGKILL\)") as info:
            llm.generate(PROMPTS, SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
        assert (info.value.rank, info.value.cause) == (1, "killed by SIGKILL")   # a death, by type
        assert time.monotonic() - killed_at[0] < 10
        with pytest.raises(WorkerError, match="earlier failure"):
            llm.engine.workers.control(Ping())
    finally:
        timer.cancel()
        llm.shutdown()
    llm.shutdown()   # twice is fine
    assert [pid for pid in pids if pid_alive(pid)] == []
    assert my_segments() == segments_before


def test_hung_worker_is_named_after_the_step_timeout(reference):
    # Also the first executor after a failed one in this process: fresh ports, fresh segment.
    with mp_llm(1, 2, num_kv_blocks=256, step_timeout_s=3) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == reference["greedy"]
        pid = llm.engine.core.executor.worker_pids[0]
        stop_process(pid)
        try:
            # Either the driver's step timeout or rank 1's timed-out recv: both must name rank 0.
            with pytest.raises(WorkerError, match=rf"(no answer within 3 s|no answer yet) from rank 0 "
                                                  rf"\(tp 0, pp 0, pid {pid}\)"):
                llm.generate(PROMPTS, GREEDY)
        finally:
            os.kill(pid, signal.SIGCONT)


EXIT_WITHOUT_SHUTDOWN = textwrap.dedent("""
    import json
    from devharness import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="mp",
                  threads_per_worker=1, num_kv_blocks=64)
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0))
        print(json.dumps({"pids": llm.engine.core.executor.worker_pids,
                          "tokens": out[0].outputs[0].token_ids}), flush=True)
        # no llm.shutdown(): interpreter exit must clean up
""")


def test_exit_without_shutdown_leaves_nothing(tmp_path):
    script = tmp_path / "no_shutdown.py"
    script.write_text(EXIT_WITHOUT_SHUTDOWN)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr
    pids = json.loads(stdout.strip().splitlines()[-1])["pids"]
    assert len(pids) == 2
    assert [pid for pid in pids if pid_alive(pid)] == []
    assert my_segments(proc.pid) == set()
    assert "leaked" not in stderr and "Traceback" not in stderr, stderr
