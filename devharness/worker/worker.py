"""Worker: one rank. Sets up its device, threads and process groups, owns a ModelRunner.

The same class runs in the driver (uni), in a child process (mp) or as a Ray actor (ray);
executors call its methods and never reach into the runner.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

import msgspec
import torch

from devharness.config import EngineConfig
from devharness.debug import breakpoints, capture, debugger, faults, numerics
from devharness.debug import profiler as profilers
from devharness.debug import state as debug_state
from devharness.debug.ledger import CollectiveLedger
from devharness.distributed import collectives
from devharness.distributed import parallel_state as ps
from devharness.distributed.rendezvous import Rendezvous
from devharness.protocol.messages import (ArmBreakpoint, ArmCapture, ArmFault, ArmRequestFault, BreakpointSpec,
                                          ClearBreakpoints, ControlCall, DebugpyInfo, GetHistory, GetStack, GetState,
                                          GetCollectives, GetNumerics, GetWeightFormat, InitDevice, InitKvCache,
                                          InjectFault, KvCacheBlockBytes, Ledger, LoadModel, ModelRunnerOutput,
                                          NumericsReport, Ping, ProfileResult, ReadClock, SchedulerOutput,
                                          StartProfile, StepRecord, StopProfile, TakeCapture, WeightFormat,
                                          WorkerState)
from devharness.model.loader import ModelSource
from devharness.worker.device import rank_device
from devharness.worker.model_runner import ModelRunner
from devharness.protocol.frames import encode, step_decoder

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """At the end of a process's start-up: move every object made so far (torch's modules, the model's, ~200k in
    all) out of the collector's reach (gc.freeze), so that a full collection walks only what steps made since,
    instead of holding a step for ~100 ms every so often. Start-up leaves no garbage behind for this to keep (a
    collection just after it finds none). Returns how many objects are frozen."""
    gc.freeze()
    return gc.get_freeze_count()
# The folder holding the devharness package this worker runs: an IDE's pathMappings "remoteRoot" (on
# another node, or when Ray shipped the package with the job, it is not the driver's checkout).
SOURCE_ROOT = str(Path(__file__).resolve().parents[2])



def _node_ip() -> str:
    # A process that has not imported Ray is no Ray worker (importing it only to ask costs half a second of CPU).
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return "127.0.0.1"




class Worker:
    """One rank of the tp x pp grid; `rank = pp_rank * tp_size + tp_rank`."""

    def __init__(self, config: EngineConfig, source: ModelSource, rank: int, max_model_len: int,
                 rendezvous: Rendezvous | None = None, own_process: bool = True,
                 store_listener: socket.socket | None = None):
        p = config.parallel
        self.config = config
        self.info = ps.ParallelInfo(rank=rank, tp_rank=rank % p.tensor_parallel_size,
                                    pp_rank=rank // p.tensor_parallel_size,
                                    tp_size=p.tensor_parallel_size, pp_size=p.pipeline_parallel_size)
        self.source = source
        self.max_model_len = max_model_len
        self.rendezvous = rendezvous
        self._store_listener = store_listener   # rank 0 across machines: the socket its store serves on
        self.own_process = own_process   # False: in the driver's process (uni), whose heap the engine looks after
        self.runner: ModelRunner | None = None
        self.recorder: debug_state.StateRecorder | None = None
        self.ledger: CollectiveLedger | None = None
        self.profiler: profilers.Profiler | None = None   # StartProfile's, until StopProfile
        # This worker's debug machinery, installed on its own runner, model and collectives only (another engine
        # in this process has its own): its breakpoints and armed faults (a watcher of the runner's steps), the
        # watchers of its collectives (made the ones told around each step: scope()), its capture and the fault
        # --inject or InjectFault planted (faults.install).
        self.breakpoints = breakpoints.Breakpoints()
        self.observers = collectives.Observers()
        self.capture: capture.Capture | None = None
        self.planted = None
        self._publishing = False
        self._wait_for_client_first = False

    @property
    def identity(self) -> str:
        i = self.info
        return f"rank {i.rank} (tp {i.tp_rank}, pp {i.pp_rank}, pid {os.getpid()})"

    def init_device(self) -> None:
        threads = self.config.parallel.threads_per_worker
        if threads is not None:
            torch.set_num_threads(threads)
        device = rank_device(self.config.model.device, self.info.rank)
        backend = self._backend = "nccl" if device.type == "cuda" else "gloo"
        async_ops = self.config.parallel.async_collectives
        collectives.set_async(device.type == "cuda" if async_ops is None else async_ops)
        timeout = self.config.debug.timeout_s if self.config.debug.enabled else self.config.parallel.step_timeout_s
        # A collective gives up a while after the driver's step timeout, so that the driver names the rank
        # that did not arrive while the others still wait for it, rather than racing their own timeouts.
        timeout += max(5.0, 0.25 * timeout)
        if self.info.world_size > 1:
            listener, self._store_listener = self._store_listener, None
            ps.init_distributed(self.info, self.rendezvous, backend, timeout, store_listener=listener)
        else:
            ps.set_parallel_info(self.info)
        self.runner = ModelRunner(self.source, self.config.model, self.config.scheduler, self.info,
                                  self.max_model_len, device, self.config.parallel.pp_layer_partition)
        # A recording keeps each sampled row's logits digest; a replay compares them.
        self.runner.digest_logits = bool(self.config.record_dir) or self.config.digest_logits
        if self.config.debug.enabled and self.config.debug.post_mortem:
            # A request that fails alone pauses here first, like any worker exception; then the step goes on.
            self.runner.on_request_error = lambda rid, e: debugger.post_mortem(e)
        self._init_debug()

    def _init_debug(self) -> None:
        """Publish this worker's state; in debug mode, listen for debuggers on port_base + rank."""
        i, dbg = self.info, self.config.debug
        st = WorkerState(rank=i.rank, tp_rank=i.tp_rank, pp_rank=i.pp_rank, node_ip=_node_ip(), pid=os.getpid(),
                         source_root=SOURCE_ROOT)
        if dbg.enabled:
            host, port = debugger.start_listener(dbg.host, dbg.port_base + i.rank)
            st.debugpy = DebugpyInfo(host, port)
            self._wait_for_client_first = i.rank in dbg.wait_ranks
        run_id = self.config.run_id or f"pid{os.getpid()}"
        self.recorder = debug_state.StateRecorder(st, run_id)
        self.ledger = CollectiveLedger(run_id, i.rank, ps.groups(), self.recorder, self._backend,
                                       collectives.is_async())
        self.breakpoints.recorder = self.recorder
        self.runner.step_watchers = (self.breakpoints,)
        self._layer_watch = breakpoints.LayerWatch(self.recorder, self.breakpoints)
        self.capture = capture.Capture(self.runner.hooks, self.runner)
        if self.config.numerics_check:
            self.runner.numerics = numerics.NumericsCheck(i, self.config.flight_steps or 64)
            self.runner.hooks.install(self.runner.numerics)
        if dbg.enabled:
            debugger.watch(self.recorder)
        self.publish_state(True)
        if self.config.inject:
            self.inject_fault(self.config.inject)

    def publish_state(self, on: bool) -> None:
        """Whether steps publish this worker's state: the recorder where the runner (scope()), the collectives
        (their observer) and the model (a layer hook) find it. On from the start; off in shutdown, and for single
        steps under a "state-ab" profile (debug/profiler.py)."""
        self._publishing = on
        (self.observers.add if on else self.observers.remove)(self.recorder)
        (self.observers.add if on else self.observers.remove)(self.ledger)
        (self.runner.hooks.install if on else self.runner.hooks.remove)(self._layer_watch)

    @contextlib.contextmanager
    def scope(self):
        """This worker's recorder, breakpoints and collective watchers as the ones this thread's calls find
        (debug_state.current_recorder(), `breakpoint()` in code, the collectives), reset when the block ends."""
        with debug_state.scope(self.recorder if self._publishing else None), breakpoints.scope(self.breakpoints), \
                collectives.observed(self.observers):
            yield

    def load_model(self) -> None:
        self.runner.load_model()
        k = self.runner.kernels
        custom = [name if choice == "custom" else f"{name} (up to {choice[8:]} rows)"
                  for name, choice in k.choices.items() if choice != "library"]
        logger.info("%s loaded layers %s; weights %s; kernels %s (custom: %s), packed weights %.1f MiB",
                    self.identity, self.runner.model.model.layer_range, self.weight_format().describe(), k.backend,
                    ", ".join(custom) or "none", self.runner.packed_bytes / 2**20)

    def weight_format(self) -> WeightFormat:
        weight_bytes, kept = self.runner.model.weight_bytes()
        src = self.runner.src
        kind = "as shipped" if kept else "float"
        if not kept and src.kind == "gguf":
            from devharness.model.gguf_loader import has_quantized_tensors
            kind = "dequantized" if has_quantized_tensors(src.path) else "float"
        return WeightFormat(kind, kept, weight_bytes, self.info.tp_rank)

    def kv_cache_block_bytes(self) -> int:
        return self.runner.kv_cache_block_bytes()

    def init_kv_cache(self, num_blocks: int) -> None:
        with self.scope():
            self.runner.init_kv_cache(num_blocks)
        frozen = f"; froze the {freeze_startup_heap()} objects made at start-up" if self.own_process else ""
        logger.info("%s: a KV cache of %d blocks%s", self.identity, num_blocks, frozen)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        if self.profiler is not None:   # StartProfile's profiler runs the step (debug/profiler.py)
            return self.profiler.step(self._execute_model, so)
        return self._execute_model(so)

    def _execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        with self.scope():   # entered after a "state-ab" profile switched publishing for this step
            return self._execute_scoped(so)

    def _execute_scoped(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        dbg = self.config.debug
        if not dbg.enabled:
            return self.runner.execute_model(so)
        debugger.sync_tracing()
        if self._wait_for_client_first:
            self._wait_for_client_first = False
            debugger.wait_for_client("waiting_for_client", sys._getframe())
        try:
            return self.runner.execute_model(so)
        except Exception as e:
            if dbg.post_mortem:
                debugger.post_mortem(e)
            raise
        finally:
            st = self.recorder.state
            if st.debugpy is not None:
                st.debugpy.client_connected = debugger.client_connected()

    def execute_model_bytes(self, message: bytes) -> bytes | None:
        """The step message as encoded once by the driver; the result encoded on the output rank only."""
        out = self.execute_model(step_decoder.decode(message))
        return None if out is None else encode(out)

    # -- inspection and control (debug) ------------------------------------------------------

    def control(self, call: ControlCall):
        """Answer a control call (protocol/messages.py): the method CONTROL_HANDLERS gives its type, called with
        the call's fields as keyword arguments."""
        return CONTROL_HANDLERS[type(call)](self, **msgspec.structs.asdict(call))

    def get_state(self) -> WorkerState:
        return self.recorder.snapshot()

    def get_history(self) -> list[StepRecord]:
        return self.recorder.history()

    def get_collectives(self) -> Ledger:
        from devharness.debug.ledger import read_ledger
        return read_ledger(self.config.run_id or f"pid{os.getpid()}", self.info.rank) or Ledger(rank=self.info.rank)

    def get_numerics(self) -> NumericsReport:
        check = self.runner.numerics
        i = self.info
        return check.report() if check is not None else NumericsReport(i.rank, i.tp_rank, i.pp_rank)

    def arm_breakpoint(self, spec: BreakpointSpec) -> bool:
        return self.breakpoints.arm(spec)

    def clear_breakpoints(self) -> int:
        return self.breakpoints.clear()

    def arm_capture(self, split: int | None = None, ops: bool = False, requests: list[str] | None = None,
                    alone: bool = False) -> None:
        self.capture.arm(split, ops, requests, alone)

    def take_capture(self) -> list:
        return self.capture.take()

    def inject_fault(self, spec: str | None) -> bool:
        faults.uninstall(self)
        return spec is not None and faults.install(faults.parse(spec), self)

    def arm_fault(self, spec: BreakpointSpec) -> bool:
        return self.breakpoints.arm_fault(spec)

    def arm_request_fault(self, request_id: str, where: str = "prepare") -> bool:
        return self.breakpoints.arm_request_fault(request_id, where)

    def get_stack(self) -> str:
        """Every thread's Python stack, from inside (needs this worker to answer; see diagnostics/stacks.py)."""
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}
        return "\n".join(f"Thread {names.get(tid, tid)}:\n" + "".join(traceback.format_stack(f))
                         for tid, f in frames.items())

    def start_profile(self, kind: str, trace_dir: str | None = None, stand_ins: bool = False) -> None:
        if self.profiler is not None:
            raise ValueError(f"a {self.profiler.kind!r} profile is running on {self.identity}: stop it first")
        self.profiler = profilers.start(self, kind, trace_dir, stand_ins)

    def stop_profile(self) -> ProfileResult:
        profiler, self.profiler = self.profiler, None
        if profiler is None:
            raise ValueError(f"no profile is running on {self.identity}: start one first")
        return profiler.stop()

    def ping(self) -> int:
        return self.info.rank

    def read_clock(self) -> int:
        return time.time_ns()

    def shutdown(self) -> None:
        if getattr(self, "profiler", None) is not None:   # a torch profile stops; a wrapped class is put back
            try:
                self.stop_profile()
            except Exception:
                logger.exception("stopping the profile at shutdown")
        ps.destroy_distributed()
        if getattr(self, "recorder", None) is not None:
            self.publish_state(False)
            faults.uninstall(self)
            self.capture.take()
            if debugger._watched is self.recorder:
                debugger.watch(None)
            self.recorder.close()
            self.recorder = None
            self.ledger.close()
            self.ledger = None


# Each control call and the Worker method that answers it, its fields passed by name (tests/worker/test_control.py
# checks that every call has one and that the names agree).
CONTROL_HANDLERS = {
    Ping: Worker.ping, ReadClock: Worker.read_clock, InitDevice: Worker.init_device, LoadModel: Worker.load_model,
    KvCacheBlockBytes: Worker.kv_cache_block_bytes, GetWeightFormat: Worker.weight_format,
    InitKvCache: Worker.init_kv_cache, GetState: Worker.get_state,
    GetHistory: Worker.get_history, GetStack: Worker.get_stack, ArmBreakpoint: Worker.arm_breakpoint,
    ClearBreakpoints: Worker.clear_breakpoints, ArmFault: Worker.arm_fault, ArmRequestFault: Worker.arm_request_fault,
    ArmCapture: Worker.arm_capture, TakeCapture: Worker.take_capture, InjectFault: Worker.inject_fault,
    GetCollectives: Worker.get_collectives, StartProfile: Worker.start_profile, StopProfile: Worker.stop_profile,
    GetNumerics: Worker.get_numerics,
}
