"""MultiprocExecutor: one spawned process per rank, on this machine.

Control plane. The driver writes every call (a step, an rpc, exit) once to its message queue
(a shared-memory ring) that all workers read, in the worker loop Ray's workers run too
(worker/worker_loop.py); each worker answers on its own pipe. The driver waits on
the pipes and the processes' sentinels together (multiprocessing.connection.wait), so it
sleeps in the kernel, wakes as soon as an answer arrives, and notices a dead worker at once.

Who answers a step (tp=2, pp=2; rank = pp_rank * tp_size + tp_rank):
    pp 0: rank 0 (tp 0), rank 1 (tp 1)   run layers 0-1, send hidden states to pp 1
    pp 1: rank 2 (tp 0), rank 3 (tp 1)   run layers 2-3, all-gather the logits; rank 2 samples
Every rank acknowledges every step, so a hang names the ranks that never answered; only the
output rank (last stage, tp 0) attaches the sampled tokens.

Several calls may be outstanding (batches in flight, a control call from another thread): each
answer carries its call's seq, and whoever waits on the pipes keeps the answers to other calls
for their own waiters.

Worker processes are forked from a `forkserver` that has imported torch and the worker code once
(per driver process): a fresh interpreter for each, as with `spawn`, without paying torch's import
(seconds of CPU) per worker and per engine. The forkserver keeps the environment it started with; the
driver's current one is applied in each worker (worker_main). A script that makes an mp LLM at import
time needs the usual `if __name__ == "__main__":` guard.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait

import msgspec

from devharness.distributed.message_queue import MessageQueue
from devharness.distributed.rendezvous import local_rendezvous, remove_folder
from devharness.executor.base import Executor, StepFuture, with_kv_alarms
from devharness.protocol.errors import WorkerDied, WorkerError
from devharness.executor.multiproc_worker import identity, worker_main
from devharness.protocol.messages import InitDevice, LoadModel, ModelRunnerOutput, Ping, SchedulerOutput
from devharness.diagnostics.hang import hang_report
from devharness.worker.device import check_available
from devharness.protocol.frames import EXIT, ControlFrame, Reply, StepCall, encoder, output_decoder, reply_decoder

logger = logging.getLogger(__name__)


_STARTUP_TIMEOUT_S = 600.0  # spawning, importing torch and loading weights: minutes on a slow machine
_LIVENESS_CHECK_S = 1.0     # a stalled broadcast looks at the workers' health (and answers) this often
_EXIT_JOIN_S = 5.0          # workers get this long to leave on their own before SIGTERM
_TERM_JOIN_S = 2.0          # ... and this long after SIGTERM before SIGKILL
_REAP_S = 1.0               # a process whose sentinel fired gets this long to report its exit status
_ERROR_GRACE_S = 0.5        # a peer's death explains a worker's error better than the error itself


class MultiprocExecutor(Executor):
    """Workers as local processes: shared-memory broadcast out, pipes back, sentinels watched."""

    uses_ray = False

    def _init_workers(self) -> None:
        check_available(self.config.model.device, self.world_size)
        self._current_step: int | None = None
        p = self.config.parallel
        self.output_rank = (p.pipeline_parallel_size - 1) * p.tensor_parallel_size
        self._timeout_s = self.config.debug.timeout_s if self.config.debug.enabled else p.step_timeout_s
        self._seq = 0
        self._failure: str | None = None
        # The queue has one writer, and one waiter at a time reads the pipes; both hold this lock.
        self._lock = threading.Lock()
        self._replies: dict[int, dict[int, Reply]] = {}   # seq of each call in flight -> answers so far, by rank
        # The ranks meet in a file store in a private folder (made anew for every set of workers): on one
        # machine nothing of the data plane needs to listen off loopback (distributed/rendezvous.py).
        queue = MessageQueue(local=list(range(self.world_size)))
        rendezvous, folder = local_rendezvous()
        self._workers = _WorkerSet(queue, self._lock, folder)
        self._finalizer = weakref.finalize(self, self._workers.stop)
        ctx = _worker_context()
        log_level = logging.getLogger("devharness").getEffectiveLevel()
        try:
            for rank in range(self.world_size):
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=worker_main, daemon=True, name=f"devharness-{identity(p, rank)}",
                                   args=(self.config, self.source, rank, self.max_model_len, rendezvous,
                                         self._workers.queue.handle(rank), send, log_level, dict(os.environ)))
                proc.start()
                send.close()   # the child holds the only write end: its death reads as EOF here
                self._workers.add(proc, recv)
            # ping first: spawned workers take seconds to import torch, and each rank should enter
            # init_device's rendezvous (bounded by the step timeout) together with its peers.
            startup_s = max(self._timeout_s, _STARTUP_TIMEOUT_S)
            for call in (Ping(), InitDevice(), LoadModel()):
                self.control(call, timeout_s=startup_s)
        except BaseException:
            self.shutdown()
            raise

    @property
    def worker_pids(self) -> list[int]:
        return [proc.pid for proc in self._workers.procs]

    @property
    def supports_async_steps(self) -> bool:
        return True

    def execute_model_async(self, so: SchedulerOutput) -> StepFuture:
        so_bytes = encoder.encode(so)
        what = f"step {so.step}"
        seq = self._submit(lambda seq: encoder.encode(StepCall(seq, msgspec.Raw(so_bytes))), what, self._timeout_s)

        def collect() -> ModelRunnerOutput:
            self._current_step = so.step
            # A failed step leaves the workers with half-applied request state: no later call may run on them.
            replies = self._collect(seq, list(range(self.world_size)), what, self._timeout_s, errors_are_fatal=True)
            out = output_decoder.decode(replies[self.output_rank].result)
            return with_kv_alarms(out, [replies[r].result for r in sorted(replies) if r != self.output_rank],
                                  output_decoder.decode)
        return StepFuture(so.step, collect)

    def _control(self, call: bytes, ranks: list[int], timeout_s: float | None, what: str) -> list[bytes]:
        timeout_s = timeout_s or self._timeout_s
        seq = self._submit(lambda seq: encoder.encode(ControlFrame(seq, msgspec.Raw(call), ranks)), what, timeout_s)
        replies = self._collect(seq, ranks, what, timeout_s, errors_are_fatal=False)
        return [replies[r].result for r in ranks]

    def check_health(self) -> None:
        if self._failure:
            raise WorkerError(f"the mp executor stopped after an earlier failure: {self._failure}")
        self._raise_if_dead("health check", grace_s=0)

    def shutdown(self, force: bool = False) -> None:
        if force:
            self._workers.failed = True   # they cannot read "exit" while a step holds them: straight to SIGTERM
        self._finalizer()

    # -- calls: broadcast, then collect the answers --------------------------------------------

    def _check_usable(self, what: str) -> None:
        if not self._finalizer.alive:
            raise RuntimeError(f"{what}: the mp executor is shut down")
        if self._failure:
            raise WorkerError(f"{what}: the mp executor stopped after an earlier failure: {self._failure}")

    def _submit(self, encode_call, what: str, timeout_s: float) -> int:
        """Broadcast `encode_call(seq)`; its seq, for _collect."""
        with self._lock:
            self._check_usable(what)
            self._seq += 1
            seq = self._seq
            self._replies[seq] = {}
            try:
                self._broadcast(encode_call(seq), time.monotonic() + timeout_s, what)
            except BaseException as e:
                del self._replies[seq]
                self._fail(e)
                raise
            return seq

    def _collect(self, seq: int, ranks: list[int], what: str, timeout_s: float,
                 errors_are_fatal: bool) -> dict[int, Reply]:
        """The answers of `ranks` to call `seq`, watching for deaths and hangs."""
        with self._lock:
            try:
                self._check_usable(what)
                try:
                    replies, errors, silent = self._await_replies(seq, ranks, time.monotonic() + timeout_s, what)
                except BaseException as e:
                    self._fail(e)
                    raise
            finally:
                self._replies.pop(seq, None)   # answers that come later are dropped
            if not errors:
                return replies
            quiet = (f" (no answer from {silent}; "
                     f"{hang_report(self.config.run_id, self.world_size, self._current_step)})") if silent else ""
            error = WorkerError(f"{what}{quiet}: " + "\n".join(text for _, text in sorted(errors)))
            # A call that every rank answered (some with an error) may leave the workers usable;
            # a rank still silent is stuck, probably in a collective with the one that failed.
            if silent or errors_are_fatal:
                self._fail(error)
            raise error

    def _fail(self, error: BaseException) -> None:
        self._failure = f"{type(error).__name__}: {error}"
        self._workers.failed = True

    def _broadcast(self, data: bytes, deadline: float, what: str) -> None:
        def on_stall(e: TimeoutError) -> None:
            # Some worker is not reading: busy with the calls before this one (a message larger than the
            # ring then streams at its pace), paused in a debugger, dead, or hung. Only the last two end it.
            self._raise_if_dead(what, grace_s=0)
            if time.monotonic() >= deadline:
                raise WorkerError(f"{what}: the workers stopped reading: {e}") from e
            self._take_ready_replies()
        self._workers.queue.write(data, timeout_s=_LIVENESS_CHECK_S, on_stall=on_stall)

    def _take_ready_replies(self) -> None:
        """Read the answers already on the pipes, for their calls' waiters: a worker blocked sending an
        answer larger than its pipe holds reads no further call until someone does."""
        conns = self._workers.conns
        for conn in wait(conns, timeout=0):
            try:
                reply = reply_decoder.decode(conn.recv_bytes())
            except (EOFError, OSError):
                continue   # a dead worker: _raise_if_dead names it
            if reply.seq in self._replies:
                self._replies[reply.seq][conns.index(conn)] = reply

    def _await_replies(self, seq: int, ranks: list[int], deadline: float, what: str):
        """(answers by rank, (rank, error text) pairs, the ranks still silent once an error came in).

        Raises WorkerError when a worker dies, or when no error came in and a rank stays silent."""
        procs, conns = self._workers.procs, self._workers.conns
        got = self._replies[seq]   # answers read earlier by the waiter of another call
        pending = {conns[r]: r for r in ranks if r not in got}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(procs)}
        start = time.monotonic()

        def missing() -> str:
            return ", ".join(identity(self.config.parallel, r, procs[r].pid) for r in sorted(pending.values()))

        def on_first_error() -> float:
            # A peer's death explains the error better (a collective that lost its peer), and the
            # ranks still running may be waiting for this one: neither gets the full timeout.
            self._raise_if_dead(what, grace_s=_ERROR_GRACE_S)
            return min(deadline, time.monotonic() + _ERROR_GRACE_S)

        if any(reply.error is not None for reply in got.values()):
            deadline = on_first_error()
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if any(reply.error is not None for reply in got.values()):
                    return (*_split(got), missing())
                raise WorkerError(f"{what}: no answer within {deadline - start:.0f} s from {missing()}; one may be "
                                  "hung (or paused in a debugger) and the others waiting for it in a collective: "
                                  f"{hang_report(self.config.run_id, self.world_size, self._current_step)}")
            ready = wait(list(pending) + list(sentinels), timeout=remaining)
            if any(obj in sentinels for obj in ready):
                self._raise_if_dead(what, grace_s=0)
            for conn in ready:
                if conn not in pending:
                    continue
                rank = pending[conn]
                try:
                    reply = reply_decoder.decode(conn.recv_bytes())
                except (EOFError, OSError):
                    self._raise_if_dead(what, grace_s=_LIVENESS_CHECK_S)
                    raise WorkerError(f"{what}: lost the answer pipe of {identity(self.config.parallel, rank)}")
                if reply.seq != seq:
                    if reply.seq in self._replies:   # another call in flight: kept for its waiter
                        self._replies[reply.seq][rank] = reply
                    continue    # else a late answer to a call that already failed
                del pending[conn]
                if reply.error is not None and all(r.error is None for r in got.values()):
                    deadline = on_first_error()
                got[rank] = reply
        return (*_split(got), "")

    def _raise_if_dead(self, what: str, grace_s: float) -> None:
        procs = self._workers.procs
        ended = set(wait([proc.sentinel for proc in procs], timeout=grace_s))
        dead = []
        for rank, proc in enumerate(procs):
            if proc.sentinel in ended:
                # The sentinel fires as the process closes its files, a moment before its exit status exists.
                proc.join(_REAP_S)
                dead.append((rank, _exit_reason(proc.exitcode), proc.pid))
        if dead:
            rank, reason, _ = dead[0]
            raise WorkerDied(f"{what}: " + "; ".join(f"{identity(self.config.parallel, r, pid)} died ({why})"
                                                    for r, why, pid in dead), rank=rank, cause=reason)


class _WorkerSet:
    """The processes, pipes and message queue of one executor; `stop()` frees them all, once, also at exit."""

    def __init__(self, queue: MessageQueue, lock: threading.Lock, rendezvous_folder: str | None = None):
        self.queue, self.lock = queue, lock
        self.rendezvous_folder = rendezvous_folder
        self.procs: list[multiprocessing.Process] = []
        self.conns: list[Connection] = []
        self.failed = False

    def add(self, proc, conn: Connection) -> None:
        self.procs.append(proc)
        self.conns.append(conn)

    def stop(self) -> None:
        # After a failure the survivors sit in collectives and cannot read "exit": go straight to SIGTERM.
        locked = not self.failed and self.lock.acquire(timeout=_LIVENESS_CHECK_S)
        try:
            join_s = 0.0
            if locked:
                try:
                    self.queue.write(EXIT, timeout_s=_LIVENESS_CHECK_S)
                    join_s = _EXIT_JOIN_S
                except TimeoutError:
                    pass
            _join_all(self.procs, join_s)
            for escalate in ("terminate", "kill"):
                alive = [proc for proc in self.procs if proc.exitcode is None]
                for proc in alive:
                    getattr(proc, escalate)()
                    if escalate == "terminate":
                        # A stopped worker (SIGSTOP, a debugger's ptrace stop) would hold SIGTERM until
                        # the SIGKILL below: let it take it now, as a shell's `kill` does.
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(proc.pid, signal.SIGCONT)
                _join_all(alive, _TERM_JOIN_S if escalate == "terminate" else None)
        finally:
            if locked:
                self.lock.release()
            for conn in self.conns:
                conn.close()
            self.queue.close()
            remove_folder(self.rendezvous_folder)


def _join_all(procs, timeout_s: float | None) -> None:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for proc in procs:
        proc.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


# -- small helpers ------------------------------------------------------------------------------

def _split(got: dict[int, Reply]) -> tuple[dict[int, Reply], list[tuple[int, str]]]:
    """(answers by rank, (rank, error text) pairs)."""
    return ({r: reply for r, reply in got.items() if reply.error is None},
            [(r, reply.error) for r, reply in got.items() if reply.error is not None])


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _worker_context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "devharness.worker.worker", "devharness.worker.worker_loop",
                                "devharness.executor.multiproc_worker"])
    return ctx

