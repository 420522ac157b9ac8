"""RayWorker: the Ray actor around one `Worker`; in "shm" mode it runs the worker loop the mp
executor's processes run (worker/worker_loop.py) on the driver's message queue.

The actor has two lanes. Ray actor calls (control calls, the compiled graph) run in the default
lane; the control-plane loop (or, in cgraph mode, a liveness sentinel) runs in the "loop"
concurrency group, so `get_stack` and friends still answer while a step is running or hung.
"""
from __future__ import annotations

import logging
import os
import socket
import threading

import ray

from devharness.config import EngineConfig
from devharness.debug import debugger, worker_log
from devharness.distributed.message_queue import QueueHandle, WorkerEnd
from devharness.distributed.rendezvous import Rendezvous, store_listener
from devharness.distributed.shm_ring import ShmBroadcast, ShmHandle
from devharness.model.loader import ModelSource
from devharness.protocol.frames import control_decoder, encode
from devharness.worker.worker import Worker
from devharness.worker.worker_loop import serve

logger = logging.getLogger(__name__)


def _log_prefix(rank: int, tp_rank: int, pp_rank: int) -> str:
    return f"[rank {rank} tp {tp_rank} pp {pp_rank} pid {os.getpid()}]"


def _install_log_prefix(prefix: str) -> None:
    """Every devharness log line from this process carries the worker's identity. A Ray actor owns its
    process, so this runs once per process; Ray's own loggers are left alone."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix} %(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("devharness")
    log.handlers = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


class RayWorker:
    """One rank as a Ray actor: builds its Worker and runs steps from a compiled graph or a channel."""

    def __init__(self, rank: int, tp_rank: int, pp_rank: int, ray_debugger: bool = False):
        self.rank, self.tp_rank, self.pp_rank = rank, tp_rank, pp_rank
        if ray_debugger:
            # Ray's own debugger (breakpoint(), post-mortem) then reuses this worker's debugpy listener. Ray reads
            # both variables when a breakpoint or an exception comes, so setting them here is enough: a
            # runtime_env would cost the actor a process of its own (Ray's setup worker) instead of an idle one.
            os.environ["RAY_DEBUG"] = "1"
            os.environ["RAY_DEBUG_POST_MORTEM"] = "1"
        self.prefix = _log_prefix(rank, tp_rank, pp_rank)
        _install_log_prefix(self.prefix)
        # A failure while starting (before the debug listener exists) must reach the driver, not pause.
        debugger.share_ray_post_mortem()
        self.worker: Worker | None = None
        self._response_ring: ShmBroadcast | None = None
        self._store_listener: socket.socket | None = None

    def __repr__(self) -> str:
        # Ray prefixes the actor's stdout/stderr lines with this.
        return f"devharness-rank{self.rank}-tp{self.tp_rank}-pp{self.pp_rank}"

    # -- placement --------------------------------------------------------------------------

    def node_info(self) -> tuple[str, str, int, int]:
        """(Ray node id, node IP, CPU cores this process may use, pid)."""
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), cpus, os.getpid()

    def open_store(self, host: str) -> int:
        """Rank 0, ranks across machines: listen for torch.distributed's store on `host` (this node's
        address) and return the port; the socket is held until the store takes it over in init_device."""
        self._store_listener = store_listener(host)
        return self._store_listener.getsockname()[1]

    def init_worker(self, config: EngineConfig, source: ModelSource, max_model_len: int,
                    rendezvous: Rendezvous) -> None:
        worker_log.capture(config.run_id or f"pid{os.getpid()}", self.rank)
        self.worker = Worker(config, source, self.rank, max_model_len, rendezvous=rendezvous,
                             store_listener=self._store_listener)
        self._store_listener = None
        logger.info("worker created; torch.distributed at %s, its backend on %s", rendezvous.init_method,
                    rendezvous.bind_address)

    # -- the three control planes ------------------------------------------------------------

    def control(self, call: bytes) -> bytes:
        """A control call (messages.py), msgpack in and out as on every backend."""
        return encode(self.worker.control(control_decoder.decode(call)))

    def execute_model_bytes(self, message: bytes) -> bytes | None:
        """One step from a compiled graph or a plain actor call."""
        return self.worker.execute_model_bytes(message)

    def create_response_ring(self) -> ShmHandle:
        """A rank that answers steps, on the driver's node: the ring its answers go back on (this actor writes and
        owns it; if the actor is killed, multiprocessing's resource tracker unlinks it)."""
        # A slot per batch in flight: answers the driver has not read yet never hold this rank up.
        self._response_ring = ShmBroadcast.create(
            num_readers=1, num_slots=max(2, self.worker.config.parallel.batches_in_flight))
        return self._response_ring.handle()

    def run_loop(self, handle: QueueHandle, answers: bool) -> int:
        """The worker loop on the driver's message queue, until ExitCall; returns the number of steps run.

        The driver holds this call's ObjectRef: it resolves with an error when the actor dies or a step
        raises, which is how the driver learns that this rank failed. Only the ranks that answer steps
        (`answers`: the output rank, and every rank with the KV sanitizer) send anything back, on their ring or
        their TCP connection.
        """
        calls = WorkerEnd(handle, self.rank)
        answer = None
        if answers:
            ring = self._response_ring
            if not calls.can_answer and ring is None:
                raise RuntimeError(f"rank {self.rank} answers steps but has no response channel")
            answer = calls.write if calls.can_answer else ring.write
        try:
            steps = serve(self.worker, calls, answer, answer_every_step=False)
        finally:
            calls.close()
            if self._response_ring is not None:
                self._response_ring.close()   # the owner unlinks it
        logger.info("step loop ended after %d steps", steps)
        return steps

    def wait_until_killed(self) -> None:
        """cgraph mode's liveness sentinel: never returns; its ObjectRef fails when the actor dies."""
        threading.Event().wait()

