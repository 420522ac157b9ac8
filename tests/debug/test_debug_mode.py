"""Debug mode end to end: a DAP client attached to a worker, rank-aware breakpoints that hold the
run without timeouts, post-mortem on a worker exception, stacks of a hung worker, safe binding."""
import contextlib
import inspect
import socket
import threading
import time

import pytest

from devharness import LLM, SamplingParams
from devharness.config import DebugConfig
from devharness.debug.breakpoints import BreakpointSpec
from devharness.diagnostics.workers import WorkerMonitor
from devharness.executor.base import WorkerError
import devharness.model.attention as attention
import devharness.kernels.reference as reference_kernels
from devharness.protocol.messages import ArmFault
from tests.debug.dap_client import DAPClient
from tests.helpers import as_inputs, free_port_base, mixed_prompts, wait_until

BACKENDS = ["mp", "ray"]
PROMPTS = as_inputs(mixed_prompts(6, seed=4))
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_instance):
    """Every test here may run on Ray: one instance for the module."""


@pytest.fixture(scope="module")
def reference():
    with LLM("tiny-llama") as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def debug_llm(backend, timeout_s=3600.0, kernels="fast", **kw):
    """tp=2 in debug mode; backend "ray-cgraph" is Ray with the Compiled Graph control plane."""
    dbg = DebugConfig(enabled=True, port_base=free_port_base(), timeout_s=timeout_s, **kw)
    plane = "cgraph" if backend == "ray-cgraph" else "shm"
    return LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend=backend.split("-")[0],
               ray_control_plane=plane, threads_per_worker=1, num_kv_blocks=64, debug=dbg, step_timeout_s=2.0,
               kernels=kernels)


@pytest.fixture(scope="module")
def serving():
    """One debug-mode tp=2 LLM per backend, shared by the tests that leave it as they found it (serving, no
    breakpoint set, no rank paused): each debug-mode engine costs seconds of CPU to start, a Ray one most. A
    test that ends its engine (post-mortem) takes it out. Tests that share one count steps from where it is."""
    llms = {}

    def get(backend):
        llm = llms.get(backend)
        if llm is not None and any(w.paused is not None for w in WorkerMonitor(llm.engine).workers()):
            llms.pop(backend).shutdown()    # a failed test left a rank paused: the next one starts afresh
        if backend not in llms:
            llms[backend] = debug_llm(backend)
        return llms[backend]

    get.release = lambda backend: llms.pop(backend).shutdown()
    yield get
    for llm in llms.values():
        llm.shutdown()


def next_step(llm) -> int:
    """The number the engine's next step will have (steps are numbered from 1 over the engine's life)."""
    return llm.engine.core.scheduler.step_count + 1


def generate_in_thread(llm):
    result = {}

    def run():
        try:
            result["outputs"] = llm.generate(PROMPTS, PARAMS)
        except BaseException as e:   # noqa: BLE001 - handed to the test
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def paused_ranks(hub) -> list[int]:
    return [w.rank for w in hub.workers() if w.paused is not None]


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_clients_hold_ranks_0_and_1_at_one_breakpoint(backend, reference, serving):
    """What the "attach all ranks" compound does: a client on each rank, both stopped at once in layer 0's
    attention in the same step, each inspected and continued on its own while the engine waits."""
    line = inspect.getsourcelines(attention.PagedAttention.forward)[1] + 5   # inside the attention forward
    get_tp_rank = "__import__('devharness.distributed.parallel_state', fromlist=['_']).get_parallel_info().tp_rank"
    llm = serving(backend)
    hub = WorkerMonitor(llm.engine)
    step, generated = next_step(llm), llm.stats()["num_generated_tokens_total"]
    clients = {}
    try:
        for rank in (0, 1):
            clients[rank] = DAPClient("127.0.0.1", llm.config.debug.port_base + rank)
            clients[rank].attach({attention.__file__: [line]})
        t, result = generate_in_thread(llm)
        stopped = {rank: c.wait_stopped() for rank, c in clients.items()}
        frames = {}
        for rank, c in clients.items():   # both held at once, each at the line, each its own rank
            assert stopped[rank]["reason"] == "breakpoint"
            assert stopped[rank]["threadId"] in [th["id"] for th in c.request("threads")["threads"]]
            frames[rank] = frame = c.stack_trace(stopped[rank]["threadId"])[0]
            assert frame["source"]["path"] == attention.__file__ and frame["line"] == line
            assert c.evaluate(get_tp_rank, frame["id"]) == str(rank)
        shapes = {rank: c.evaluate("tuple(q.shape)", frames[rank]["id"]) for rank, c in clients.items()}
        assert shapes[0] == shapes[1], shapes    # each rank holds its half of the heads
        wait_until(lambda: paused_ranks(hub) == [0, 1], 10, "both ranks paused in their states")
        for w in hub.workers():
            assert (w.paused.reason, w.paused.file, w.paused.line, w.step) == \
                   ("breakpoint", attention.__file__, line, step)
            assert w.debugpy.client_connected
        assert llm.stats()["num_generated_tokens_total"] == generated and t.is_alive()

        clients[0].set_breakpoints(attention.__file__, [])
        clients[0].continue_(stopped[0]["threadId"])
        # Rank 0 goes on to layer 0's o_proj all-reduce and waits there for rank 1, still stopped.
        wait_until(lambda: hub.worker_state(0).phase == "collective", 10, "rank 0 waiting in a collective")
        st0 = hub.worker_state(0)
        assert st0.paused is None and st0.detail == "layer 0 attention all_reduce" and st0.waiting_for == [1]
        time.sleep(llm.config.parallel.step_timeout_s + 0.5)    # longer than the non-debug timeout
        assert paused_ranks(hub) == [1]
        assert clients[1].stack_trace(stopped[1]["threadId"])[0]["line"] == line
        assert t.is_alive() and "error" not in result and llm.stats()["num_generated_tokens_total"] == generated

        clients[1].set_breakpoints(attention.__file__, [])
        clients[1].continue_(stopped[1]["threadId"])
        t.join(120)
    finally:
        for c in clients.values():
            c.disconnect()
    assert "error" not in result, result.get("error")
    assert tokens(result["outputs"]) == reference


def test_reference_kernels_in_debug_mode_stop_in_the_decode_kernel(reference):
    """With --kernels reference, every op is plain torch in Python: a breakpoint inside the reference decode
    attention (the op the fast backend runs in C) stops there, and the run goes on to the same tokens."""
    kernels = reference_kernels
    source, first = inspect.getsourcelines(kernels.paged_decode)
    line = first + next(i for i, text in enumerate(source) if "flat = " in text)   # inside the reference kernel
    with debug_llm("mp", kernels="reference") as llm:
        assert llm.config.model.kernels == "reference"
        client = DAPClient("127.0.0.1", llm.config.debug.port_base)
        try:
            client.attach({kernels.__file__: [line]})
            t, result = generate_in_thread(llm)
            stopped = client.wait_stopped()
            frame = client.stack_trace(stopped["threadId"])[0]
            assert (stopped["reason"], frame["source"]["path"], frame["line"]) == ("breakpoint", kernels.__file__, line)
            assert frame["name"] == "paged_decode"
            client.set_breakpoints(kernels.__file__, [])
            client.continue_(stopped["threadId"])
            t.join(120)
        finally:
            client.disconnect()
    assert "error" not in result, result.get("error")
    assert tokens(result["outputs"]) == reference


@pytest.mark.parametrize("backend", BACKENDS + ["ray-cgraph"])
def test_armed_breakpoint_holds_run_past_timeout(backend, reference, serving):
    """The Compiled Graph plane gets an engine of its own; the others share theirs."""
    with contextlib.nullcontext(serving(backend)) if backend in BACKENDS else debug_llm(backend) as llm:
        hub = WorkerMonitor(llm.engine)
        step = next_step(llm) + 4   # the fifth step of this test's run
        assert hub.arm_breakpoint(BreakpointSpec(rank=1, step=step)) == [1]
        t, result = generate_in_thread(llm)
        paused = wait_until(lambda: hub.worker_state(1).paused, 60, "rank 1 paused")
        st1, st0 = hub.worker_state(1), hub.worker_state(0)
        assert st1.step == step and paused.reason == "breakpoint"
        assert paused.file.endswith("model_runner.py")
        wait_until(lambda: hub.worker_state(0).phase == "collective", 10, "rank 0 in a collective")
        st0 = hub.worker_state(0)
        # Rank 1 stopped before its first collective: rank 0 waits in the embedding's.
        assert st0.paused is None and st0.step == step and st0.detail == "embedding all_reduce"
        assert st0.waiting_for == [1]
        # The stack of the rank hung in the collective shows the collective.
        assert "tp_all_reduce" in hub.stack(0)["stacks"]
        time.sleep(2.0 * llm.config.parallel.step_timeout_s)    # longer than the non-debug timeout
        assert t.is_alive() and "error" not in result
        client = DAPClient("127.0.0.1", llm.config.debug.port_base + 1)
        try:
            client.attach()
            stopped = client.wait_stopped()
            frame = client.stack_trace(stopped["threadId"])[0]
            assert frame["source"]["path"].endswith("model_runner.py")
            assert client.evaluate("so.step", frame["id"]) == str(step)
            client.continue_(stopped["threadId"])
            t.join(120)
        finally:
            client.disconnect()
    assert "error" not in result, result.get("error")
    assert tokens(result["outputs"]) == reference


@pytest.mark.parametrize("backend", BACKENDS)
def test_post_mortem_pauses_on_worker_exception(backend, serving):
    """Ends the shared engine: the worker error is the engine's death."""
    llm = serving(backend)
    try:
        hub = WorkerMonitor(llm.engine)
        step = next_step(llm) + 2
        llm.engine.workers.control(ArmFault(BreakpointSpec(rank=1, step=step)), [1])
        t, result = generate_in_thread(llm)
        paused = wait_until(lambda: hub.worker_state(1).paused, 60, "rank 1 paused on the exception")
        assert paused.reason == "exception" and paused.file.endswith("breakpoints.py")
        client = DAPClient("127.0.0.1", llm.config.debug.port_base + 1)
        try:
            client.attach()
            stopped = client.wait_stopped()
            assert stopped["reason"] == "exception"
            info = client.exception_info(stopped["threadId"])
            assert "InjectedFault" in info["exceptionId"] and f"step {step}" in info["description"]
            client.continue_(stopped["threadId"])
            t.join(60)
        finally:
            client.disconnect()
    finally:
        serving.release(backend)
    assert isinstance(result.get("error"), WorkerError)
    assert "rank 1" in str(result["error"]) and "fault injected" in str(result["error"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_worker_exception_without_debug_names_rank(backend):
    with LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend=backend, threads_per_worker=1,
             num_kv_blocks=64) as llm:
        llm.engine.workers.control(ArmFault(BreakpointSpec(rank=1, step=2)), [1])
        with pytest.raises(WorkerError, match=r"rank 1.*fault injected|fault injected.*rank 1"):
            llm.generate(PROMPTS, PARAMS)


def _listening(port: int) -> set[str]:
    """Local addresses listening on `port` (IPv4), from /proc/net/tcp."""
    found = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            ip_hex, port_hex = local.split(":")
            if int(port_hex, 16) == port and state == "0A":
                found.add(socket.inet_ntoa(bytes.fromhex(ip_hex)[::-1]))
    return found


def test_listeners_bind_loopback_unless_told(caplog):
    with debug_llm("mp") as llm:
        base = llm.config.debug.port_base
        assert _listening(base) == {"127.0.0.1"} and _listening(base + 1) == {"127.0.0.1"}
    with caplog.at_level("WARNING"):
        with debug_llm("mp", host="0.0.0.0") as llm:
            assert _listening(llm.config.debug.port_base) == {"0.0.0.0"}
    assert any("0.0.0.0" in r.getMessage() and "run any code" in r.getMessage() for r in caplog.records)


def test_debug_wait_holds_rank_until_a_client_attaches(reference):
    with debug_llm("mp", wait_ranks=[1]) as llm:
        hub = WorkerMonitor(llm.engine)
        t, result = generate_in_thread(llm)
        paused = wait_until(lambda: hub.worker_state(1).paused, 60, "rank 1 waiting for a client")
        assert paused.reason == "waiting_for_client" and hub.worker_state(0).paused is None
        time.sleep(1.0)
        assert t.is_alive() and hub.worker_state(1).step <= 1
        client = DAPClient("127.0.0.1", llm.config.debug.port_base + 1)
        try:
            client.attach()
            t.join(120)
        finally:
            client.disconnect()
    assert tokens(result["outputs"]) == reference

