"""The Ray executor on one local Ray instance: every tp x pp layout and control plane gives the
tp=1, pp=1 tokens (with and without preemption), actors carry their identity, a killed worker
becomes a WorkerError naming its rank, shutdown (or a driver that exits without it) leaves nothing
behind, and smollm2 runs at pp=2 but is refused at tp=2."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import pytest

import ray

from devharness import LLM, SamplingParams  # noqa: E402
from devharness.executor.base import WorkerError  # noqa: E402
from devharness.distributed import message_queue  # noqa: E402
from devharness.distributed.shm_ring import SHM_PREFIX  # noqa: E402
from tests.helpers import as_inputs, frozen_at_startup, mixed_prompts, pid_alive, stop_process  # noqa: E402

PROMPTS = as_inputs(mixed_prompts(16))
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# tp=2, pp=2 runs with so few KV blocks that the scheduler must preempt.
SMALL_KV_BLOCKS = 24
# Step messages larger than the step ring: the ring is made small here (SMALL_RING: 4 slots of 512 bytes, where a run
# has 8 of 256 KiB), and a request biased on every token of tiny-llama's vocabulary takes 3 KB of its step message.
SMALL_RING = (512, 4)
BIG_MESSAGE = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                             logit_bias={t: ((t * 37) % 101) / 1000 - 0.05 for t in range(264)})
FEW_PROMPTS = PROMPTS[:4]


@pytest.fixture(scope="module")
def reference_tokens():
    with LLM("tiny-llama", distributed_executor_backend="uni", threads_per_worker=1) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def big_message_reference():
    with LLM("tiny-llama", distributed_executor_backend="uni", threads_per_worker=1) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(FEW_PROMPTS, BIG_MESSAGE)]


def ray_llm(tp: int, pp: int, mode: str, model: str = "tiny-llama", **kwargs) -> LLM:
    return LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="ray",
               ray_control_plane=mode, threads_per_worker=1, **kwargs)


def shm_segments_of(pids) -> set[str]:
    """Segments created by these processes (ShmBroadcast names carry the creator's pid)."""
    prefixes = tuple(f"{SHM_PREFIX}{pid}_" for pid in pids)
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefixes)}


def wait_until(cond, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


@pytest.mark.parametrize("mode", ["cgraph", "shm"])
@pytest.mark.parametrize("tp,pp", [(2, 2)])
def test_tokens_match_single_worker(ray_instance, reference_tokens, big_message_reference, tp, pp, mode, monkeypatch):
    """tp=2, pp=1 and tp=1, pp=2 are checked the same way by test_killed_worker_raises_and_shutdown_cleans_up, on the
    LLM it kills (before the kill) and on the one it starts after (each layout's actors cost seconds to start).
    Then step messages larger than the ring (made small here) reach a rank paused (as in a debugger) for longer than
    the driver's write timeout, and the workers go on (on a compiled graph, Ray's channel carries them)."""
    monkeypatch.setattr(message_queue, "RING_SLOT_BYTES", SMALL_RING[0])
    monkeypatch.setattr(message_queue, "RING_SLOTS", SMALL_RING[1])
    with ray_llm(tp, pp, mode, num_kv_blocks=SMALL_KV_BLOCKS) as llm:
        check_layout_of(llm, reference_tokens, tp, pp, mode)
        if mode == "shm":
            ring = llm.engine.core.executor._res.queue.ring.handle()
            assert (ring.slot_bytes, ring.num_slots) == SMALL_RING
        assert len(msgspec.msgpack.encode(BIG_MESSAGE)) > SMALL_RING[0] * SMALL_RING[1]
        pid = llm.engine.core.executor.worker_pids[-1]
        stop_process(pid)
        resume = threading.Timer(2.5, os.kill, (pid, signal.SIGCONT))
        resume.start()
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(FEW_PROMPTS, BIG_MESSAGE)]
        finally:
            resume.cancel()
            os.kill(pid, signal.SIGCONT)
        assert got == big_message_reference
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == reference_tokens[:2]
        if mode == "shm":
            # The same rank dies while such a message waits for it: the write ends, naming it, long before the
            # step timeout (120 s).
            stop_process(pid)
            killer = threading.Timer(1.5, os.kill, (pid, signal.SIGKILL))
            killer_started = time.monotonic()
            killer.start()
            with pytest.raises(WorkerError, match=rf"rank {tp * pp - 1} \(tp {tp - 1}, pp {pp - 1}\b"):
                llm.generate(FEW_PROMPTS, BIG_MESSAGE)
            raised_at = time.monotonic()
            killer.join()
            assert raised_at - killer_started < 30


def check_layout(reference_tokens, tp, pp, mode):
    with ray_llm(tp, pp, mode, num_kv_blocks=SMALL_KV_BLOCKS) as llm:
        check_layout_of(llm, reference_tokens, tp, pp, mode)


def check_layout_of(llm, reference_tokens, tp, pp, mode):
    """A fresh tp x pp LLM on Ray with few KV blocks gives the tp=1, pp=1 tokens with and without preemption, with
    its actors named by rank, on the control plane asked for."""
    ex = llm.engine.core.executor
    # shm: pp batches in flight (the default); a compiled graph runs one at a time.
    assert llm.engine.core.max_concurrent_batches == (pp if mode == "shm" else 1)
    # Two at a time the cache holds everything; all sixteen at once it must preempt.
    pairs = [o.outputs[0].token_ids for i in range(0, len(PROMPTS), 2)
             for o in llm.generate(PROMPTS[i:i + 2], GREEDY)]
    assert pairs == reference_tokens and llm.stats()["num_preemptions"] == 0
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == reference_tokens
    assert llm.stats()["num_preemptions"] > 0
    actors = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    for rank in range(tp * pp):
        assert f"devharness-{ex.id}-rank{rank}-tp{rank % tp}-pp{rank // tp}" in actors
    expected = "cgraph" if mode == "cgraph" else "shm"
    assert ex.control_paths() == dict.fromkeys(range(tp * pp), expected)
    assert all(frozen_at_startup(llm.engine.config.run_id, rank) > 10_000 for rank in range(tp * pp))


@pytest.mark.parametrize("mode", ["cgraph", "shm"])
def test_killed_worker_raises_and_shutdown_cleans_up(ray_instance, reference_tokens, mode):
    """The LLM it kills a worker of is first checked as every layout is (tp=2, pp=1); after the kill the same Ray
    instance serves a new LLM, tp=1 x pp=2, checked the same way."""
    llm = ray_llm(2, 1, mode, num_kv_blocks=SMALL_KV_BLOCKS)
    check_layout_of(llm, reference_tokens, 2, 1, mode)
    ex = llm.engine.core.executor
    pids, pg_id = list(ex.worker_pids), ex.placement_group_id
    # Rank 1 is not the output rank: the driver never waits on it directly.
    victim = 1
    killed_at = []
    start = llm.engine.core.scheduler.step_count

    def kill_after_a_few_steps():
        if wait_until(lambda: llm.engine.core.scheduler.step_count >= start + 3, 60):
            os.kill(pids[victim], signal.SIGKILL)
            killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_after_a_few_steps, daemon=True)
    killer.start()
    # Long enough to be running when the kill comes; each request fits the few blocks alone.
    long_run = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    with pytest.raises(WorkerError, match=f"rank {victim}") as info:
        llm.generate(as_inputs(mixed_prompts(4)), long_run)
    raised_at = time.monotonic()
    killer.join(5)
    assert killed_at, f"generate ended before the kill: {info.value}"
    assert raised_at - killed_at[0] < 10.0, f"WorkerError came {raised_at - killed_at[0]:.1f} s after the kill"

    llm.shutdown()
    llm.shutdown()  # idempotent
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 30), "a worker process outlived shutdown"
    assert ray.util.placement_group_table()[pg_id]["state"] == "REMOVED"
    # The driver's step ring and the output rank's result ring.
    assert wait_until(lambda: not shm_segments_of([os.getpid(), *pids]), 10), "a shm segment outlived shutdown"

    # The same Ray instance serves a new LLM: tp=1, pp=2 on this control plane, checked as every layout is.
    check_layout(reference_tokens, 1, 2, mode)


def test_interpreter_exit_without_shutdown_leaves_nothing(ray_instance, tmp_path):
    script = tmp_path / "forgets_shutdown.py"
    script.write_text(
        "import json, os, ray\n"
        f"ray.init(address={ray.get_runtime_context().gcs_address!r}, log_to_driver=False)\n"
        "from devharness import LLM\n"
        "llm = LLM('tiny-llama', tensor_parallel_size=2, distributed_executor_backend='ray',\n"
        "          ray_control_plane='shm', threads_per_worker=1)\n"
        "ex = llm.engine.core.executor\n"
        "print(json.dumps({'driver': os.getpid(), 'pids': ex.worker_pids, 'pg': ex.placement_group_id}))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    held = json.loads(proc.stdout.strip().splitlines()[-1])
    assert wait_until(lambda: not any(pid_alive(p) for p in held["pids"]), 30), "a worker outlived its driver"
    assert wait_until(lambda: ray.util.placement_group_table()[held["pg"]]["state"] == "REMOVED", 30)
    assert wait_until(lambda: not shm_segments_of([held["driver"], *held["pids"]]), 10), "a shm segment outlived its driver"


def test_smollm2_pp2_matches_pp1_and_tp2_is_refused(ray_instance):
    try:
        LLM("smollm2", tensor_parallel_size=2, distributed_executor_backend="ray")
    except ValueError as e:
        # Refused while checking the config, before a single actor starts.
        assert "9 attention heads" in str(e) and "[1, 3, 9]" in str(e), str(e)
    else:
        pytest.fail("tensor_parallel_size=2 was accepted for smollm2's 9 heads")
    prompts = ["Hello, my name is", "The capital of France is", "1, 2, 3,"]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM("smollm2", distributed_executor_backend="uni", threads_per_worker=1) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    with ray_llm(1, 2, "shm", model="smollm2") as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == reference
