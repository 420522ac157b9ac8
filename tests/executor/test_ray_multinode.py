"""The Ray executor across two Ray nodes (both on this machine): workers on the driver's node read
the shared-memory ring, workers on the other node fall back to TCP, and the tokens still match; with the
KV sanitizer a rank there that returns no tokens answers each step over TCP, its KV checksum alarms too.
Also the TCP fallback channel on its own: whole frames, and strangers turned away."""
import ipaddress
import pathlib
import time
import socket

import psutil
import pytest

import ray
from ray.cluster_utils import Cluster  # noqa: E402

from devharness import LLM, SamplingParams  # noqa: E402
from devharness.diagnostics.workers import WorkerMonitor  # noqa: E402
from devharness.distributed.tcp_channel import TcpDriverChannel, TcpWorkerChannel  # noqa: E402
from devharness.monitor import trace  # noqa: E402
from tests.helpers import as_inputs, mixed_prompts  # noqa: E402
from tests.monitor.test_trace import assert_collectives_overlap  # noqa: E402
from tests.conftest import own_ray  # noqa: E402
from tests.engine.test_kv_checksums import assert_bitflip_named  # noqa: E402

PROMPTS = as_inputs(mixed_prompts(16))
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def two_nodes():
    own_ray()
    # Two CPUs per node and PACK: four workers must spill onto the second node.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def test_other_node_uses_tcp_and_tokens_match(two_nodes):
    with LLM("tiny-llama", distributed_executor_backend="uni", threads_per_worker=1) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]

    assert not ray.is_initialized()
    llm = LLM("tiny-llama", tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="ray",
              ray_control_plane="shm", ray_address=two_nodes.address, threads_per_worker=1)
    try:
        ex = llm.engine.core.executor
        driver_node = ray.get_runtime_context().get_node_id()
        # Ranks fill the driver's node first, so the output rank (2) is remote: its results come back
        # over TCP too.
        assert [node == driver_node for node in ex.node_ids] == [True, True, False, False]
        assert ex.control_paths() == {0: "shm", 1: "shm", 2: "tcp", 3: "tcp"}
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert got == reference
        # Across nodes the data plane listens on the nodes' own address, never on every interface: rank 0's
        # store, each rank's gloo pairs, the driver's step channel (on one node all of it is on loopback:
        # test_loopback.py), and `serve` names them in one line.
        node_ip = ex.node_ips[0]
        assert ex._res.queue.tcp.address[0] == node_ip
        for rank, pid in enumerate(ex.worker_pids):
            ray_port = ray.get(ex.actors[rank].__ray_call__.remote(_ray_grpc_port))   # Ray's own, the cluster's
            ours = [(_unmapped(c.laddr.ip), c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN and c.laddr.port != ray_port]
            assert ours and all(ip == ex.node_ips[rank] for ip, _ in ours), (rank, ours)
            if rank == 0:
                assert ex.rendezvous.store_address in ours, ours
        line = ex.exposure()
        assert line.startswith("devharness: reachable from other machines: ") and "\n" not in line, line
        assert f"torch.distributed's store at {node_ip}:" in line and "gloo's ports" in line, line
        assert "step channel at" in line and "ranks 2, 3 on other nodes" in line and "Ray's own on" in line, line
        # Workers on the other node publish into its memory: the driver's view asks them over Ray.
        hub = WorkerMonitor(llm.engine)
        assert hub.remote_ranks == {2, 3}
        last_step = llm.stats()["step"]
        # A last step that only drops finished requests needs no answer from rank 0 (it has no collective
        # in it): rank 0 may publish it a moment after the output rank answered.
        deadline = time.monotonic() + 10
        while (states := hub.workers()) and any(w.step != last_step for w in states) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(w.rank, w.tp_rank, w.pp_rank) for w in states] == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
        assert all(w.alive and w.step == last_step and w.kv_blocks_total > 0 for w in states), states
        # The package travels with the job (a node needs only its dependencies): Ray has put a copy on
        # the other node's import path (here an installed devharness comes first; on a node without one,
        # the copy is what runs). Each worker says which copy it runs: an IDE's pathMappings remoteRoot.
        shipped = ray.get(ex.actors[2].__ray_call__.remote(_shipped_copies))
        assert shipped and all("runtime_resources" in p for p in shipped), shipped
        assert all(pathlib.Path(w.source_root, "devharness", "worker", "worker.py").is_file() for w in states)
        # Its history ends at the last step that ran the model (a batch in flight behind it may only have
        # dropped finished requests, which makes no history record).
        _, steps, _ = llm.engine.core.flight.window()
        last_run = max(st.scheduler_output.step for st in steps if st.scheduler_output.num_scheduled_tokens)
        assert [r.step for r in hub.history(2)][-1] == last_run
        # Their stacks come from py-spy run on their node (a Ray task pinned there), not from the worker.
        stack = hub.stack(2)
        assert stack["pid"] == ex.worker_pids[2] and "RayWorker.run_loop" in stack["stacks"], stack
        # So do their logs (read from the log file on their node).
        assert any("loaded layers" in line for line in hub.logs(2)), hub.logs(2)
        # One clock: the trace puts every rank on the driver's (each rank's offset measured at start-up; here the
        # nodes share the machine's clock, so every offset is within its measuring error), and on it each tp
        # collective's start and end on the two ranks of a group overlap, on this node and on the other.
        src = trace.read_engine(llm.engine)
        offsets, errors = src.driver.clock_offsets_ns, src.driver.clock_uncertainty_ns
        assert set(offsets) == set(errors) == {0, 1, 2, 3}
        assert all(abs(offsets[r]) <= errors[r] + 2_000_000 for r in offsets), (offsets, errors)
        assert_collectives_overlap(trace.trace_events(src), {"tp0": (0, 1), "tp1": (2, 3)})
    finally:
        llm.shutdown()
    # The executor connected to the cluster, so it disconnects; the cluster itself stays up.
    assert not ray.is_initialized()


def test_a_kv_checksum_alarm_comes_back_over_tcp(two_nodes, tmp_path, caplog):
    """Rank 3 (the second stage's tp rank 1, on the other node) returns no tokens; a kv-bitflip in its copy of layer 3
    still ends the request reading it, named by rank 3."""
    layout = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "distributed_executor_backend": "ray",
              "ray_control_plane": "shm", "ray_address": two_nodes.address}
    assert_bitflip_named(layout, 3, 3, tmp_path, caplog)
    assert not ray.is_initialized()


def _ray_grpc_port(actor) -> int:
    """The port of Ray's gRPC server in this worker process (every Ray worker has one)."""
    from ray.core.generated.common_pb2 import Address
    worker = ray._private.worker.global_worker
    return Address.FromString(worker.core_worker.get_owner_address(ray.put(0))).port


def _unmapped(host: str) -> str:
    addr = ipaddress.ip_address(host)
    return str(addr.ipv4_mapped or addr) if addr.version == 6 else host


def _shipped_copies(actor) -> list[str]:
    """The folders on this actor's import path that hold a devharness package Ray delivered."""
    import os
    import sys
    return [p for p in sys.path if "runtime_resources" in p
            and (os.path.isfile(os.path.join(p, "devharness", "__init__.py"))
                 or os.path.isfile(os.path.join(p, "__init__.py")) and os.path.basename(p) == "devharness")]


def test_without_an_address_a_run_starts_its_own_ray(two_nodes, monkeypatch):
    """A cluster runs on this machine, but nobody asked for it: the run must not land on it."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    with LLM("tiny-llama", distributed_executor_backend="ray", threads_per_worker=1) as llm:
        own = ray.get_runtime_context().gcs_address
        assert own != two_nodes.address
        assert len(llm.generate(PROMPTS[:2], GREEDY)) == 2
    assert not ray.is_initialized()


def test_tcp_channel_keeps_frames_whole_and_turns_strangers_away():
    token = b"t" * 16
    driver = TcpDriverChannel.listen("127.0.0.1", token, send_timeout_s=5.0)
    try:
        oversized = socket.create_connection(driver.address)
        oversized.sendall(b"\xff\xff\xff\xff")          # claims a 4 GiB hello
        wrong_token = TcpWorkerChannel.connect(driver.address, 1, b"x" * 16)
        worker = TcpWorkerChannel.connect(driver.address, 1, token)
        driver.accept({1}, timeout_s=10.0)
        assert set(driver.peers) == {1}
        with pytest.raises(ConnectionError):
            wrong_token.read(5.0)
        assert oversized.recv(1) == b""

        big = bytes(range(256)) * 1000   # many TCP segments: read back whole
        driver.broadcast(big)
        driver.broadcast(b"next")
        assert worker.read(5.0) == big
        assert worker.read(5.0) == b"next"
        assert driver.read_from(1, 0.05) is None
        worker.write(b"result")
        assert driver.read_from(1, 5.0) == b"result"
        for ch in (worker, wrong_token, oversized):
            ch.close()
    finally:
        driver.close()
