"""The driver's view of every worker: published states, step histories, stacks, breakpoints.

Everything here works while a worker is paused or hung: states and histories are read from the
workers' shared-memory files, stacks through py-spy. Workers on another Ray node publish into that
node's memory, out of the driver's reach: their state is asked for over Ray (a lane of the actor
apart from the step, so it answers during a step), and the last answer stays shown if one is late.
"""
from __future__ import annotations

import os
import time

import msgspec

from devharness.debug import worker_log
from devharness.debug.ledger import LedgerReader
from devharness.debug.redact import redact
from devharness.debug.state import StateReader, release_path
from devharness.protocol.errors import WorkerDied
from devharness.protocol.messages import (ArmBreakpoint, BreakpointSpec, ClearBreakpoints, EngineStats, GetCollectives,
                                          GetHistory, GetState, Ledger, Snapshot, StepRecord, WorkerState)
from devharness.diagnostics import stacks
from devharness.diagnostics.hang import mark_stopped

LOCAL_IPS = {"127.0.0.1", "localhost"}
REMOTE_EVERY_S = 0.2     # how often a worker on another node is asked for its state
REMOTE_TIMEOUT_S = 2.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # a killed child its parent has not reaped yet is a zombie: dead all the same
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False   # it ended meanwhile
    except OSError:
        return True


def _touch(path) -> None:
    path.touch(mode=0o600)


class WorkerMonitor:
    """Reads the workers of one engine; `snapshot()` is the /debug/workers document."""

    def __init__(self, engine):
        self.engine = engine
        cfg = engine.config
        self.run_id = cfg.run_id
        self.world_size = cfg.parallel.world_size
        self.tp_size = cfg.parallel.tensor_parallel_size
        self.readers = [StateReader(self.run_id, r) for r in range(self.world_size)]
        self.ledgers = [LedgerReader(self.run_id, r) for r in range(self.world_size)]
        self._local_ips = set(LOCAL_IPS)
        self._driver_node: str | None = None
        workers = self._workers = engine.workers
        if workers.uses_ray:
            import ray
            # Asked after the workers' Ray was shut down (a bundle for the step that a forced shutdown failed),
            # these calls would start a fresh local Ray instance: seconds, during a shutdown. Every rank then
            # counts as local, which is all a bundle of dead workers can use.
            if ray.is_initialized():
                self._local_ips.add(ray.util.get_node_ip_address())
                self._driver_node = ray.get_runtime_context().get_node_id()
        self._last_known: dict[int, WorkerState] = {}
        self._asked_at: dict[int, float] = {}

    @property
    def clock_offsets_ns(self) -> dict[int, int]:
        """Each rank's clock less the driver's (measured once at start-up): what diagnostics/timeline.align takes."""
        return getattr(self.engine, "clock_offsets_ns", None) or {}

    @property
    def remote_ranks(self) -> set[int]:
        """Ranks on another Ray node than the driver; looked up each time, as a restart may place them anew."""
        if self._driver_node is None:
            return set()
        return {r for r, node in enumerate(self._workers.node_ids) if node != self._driver_node}

    def _placeholder(self, rank: int) -> WorkerState:
        return WorkerState(rank=rank, tp_rank=rank % self.tp_size, pp_rank=rank // self.tp_size, node_ip="",
                           pid=0, phase="idle", detail="starting", alive=True)

    def _remote_state(self, rank: int) -> WorkerState | None:
        """A worker on another node, over Ray; at most every REMOTE_EVERY_S, else the last answer."""
        now = time.monotonic()
        if now - self._asked_at.get(rank, 0.0) < REMOTE_EVERY_S and rank in self._last_known:
            return self._last_known[rank]
        self._asked_at[rank] = now
        try:
            return self._workers.control(GetState(), [rank], timeout_s=REMOTE_TIMEOUT_S)[0]
        except Exception as e:   # late (busy node) or dead: the executor says which, by the error's type
            last = self._last_known.get(rank)
            dead = isinstance(e, WorkerDied)
            if last is not None and not dead:
                return last
            base = last or self._placeholder(rank)
            return msgspec.structs.replace(base, alive=not dead, phase="dead" if dead else base.phase,
                                           detail=f"no answer over Ray: {str(e).splitlines()[0][:120]}")

    def worker_state(self, rank: int) -> WorkerState:
        st = self._remote_state(rank) if rank in self.remote_ranks else self.readers[rank].state()
        if st is None:
            st = self._last_known.get(rank) or self._placeholder(rank)
        else:
            self._last_known[rank] = st
        if st.pid and self.is_local(st):
            if not _pid_alive(st.pid):
                st = msgspec.structs.replace(st, alive=False, phase="dead", detail=f"process {st.pid} is gone")
            else:
                st = mark_stopped(st)
        return st

    def is_local(self, st: WorkerState) -> bool:
        return st.rank not in self.remote_ranks and (st.node_ip in self._local_ips or not st.node_ip)

    def workers(self) -> list[WorkerState]:
        return [self.worker_state(r) for r in range(self.world_size)]

    def snapshot(self, engine: EngineStats) -> Snapshot:
        return Snapshot(engine=engine, workers=self.workers(), time=time.time())

    def history(self, rank: int) -> list[StepRecord]:
        self._check_rank(rank)
        if rank in self.remote_ranks:
            try:
                return self._workers.control(GetHistory(), [rank], timeout_s=REMOTE_TIMEOUT_S)[0]
            except Exception:
                return []
        return self.readers[rank].history()

    def collectives(self, rank: int, last: int | None = None) -> Ledger:
        """That worker's collective ledger (debug/ledger.py), its newest `last` entries: read from its shared
        memory, so it answers while the worker is paused or hung; over Ray for a worker on another node."""
        self._check_rank(rank)
        if rank in self.remote_ranks:
            try:
                got = self._workers.control(GetCollectives(), [rank], timeout_s=REMOTE_TIMEOUT_S)[0]
            except Exception:
                got = Ledger(rank=rank)
        else:
            got = self.ledgers[rank].read() or Ledger(rank=rank)
        if last is not None and len(got.entries) > last:
            got.entries = got.entries[len(got.entries) - last:]
        return got

    def stack(self, rank: int) -> dict:
        """Every thread's Python stack of that worker, read from outside (works while paused or hung)."""
        self._check_rank(rank)
        st = self.worker_state(rank)
        if not st.pid:
            raise stacks.StackError(f"rank {rank} has not started yet")
        if not st.alive:
            raise stacks.StackError(f"rank {rank} (pid {st.pid}) is dead")
        if self.is_local(st):
            text = stacks.dump_stacks(st.pid)
        else:
            text = stacks.dump_stacks_on_node(self._workers.node_ids[rank], st.pid)
        # Masked there by the flags' names, and here by the secrets this process knows.
        return {"rank": rank, "pid": st.pid, "node_ip": st.node_ip, "stacks": redact(text)}

    def logs(self, rank: int, max_lines: int = 200) -> list[str]:
        """The last lines that worker printed or logged, from its log file (works while paused or hung)."""
        self._check_rank(rank)
        path = worker_log.log_path(self.run_id, rank)
        if rank in self.remote_ranks:
            lines = stacks.on_node(self._workers.node_ids[rank], worker_log.tail, path, max_lines,
                                   timeout_s=REMOTE_TIMEOUT_S * 10)
        else:
            lines = worker_log.tail(path, max_lines)
        return [redact(line) for line in lines]

    def arm_breakpoint(self, spec: BreakpointSpec) -> list[int]:
        """Arm `spec` on the workers it names; returns their ranks."""
        ranks = [r for r in range(self.world_size)
                 if spec.matches_worker(self._placeholder(r))]
        if not ranks:
            raise ValueError(f"no worker matches {msgspec.to_builtins(spec)} "
                             f"(ranks 0..{self.world_size - 1}, tp size {self.tp_size})")
        self._workers.control(ArmBreakpoint(spec), ranks)
        return ranks

    def paused_workers(self) -> list[WorkerState]:
        """Workers that sit at a breakpoint or post-mortem, or wait for a debugger, now."""
        return [st for st in map(self.worker_state, range(self.world_size)) if st.paused is not None and st.alive]

    def release(self, rank: int | None = None) -> dict:
        """Let every paused worker (or `rank`) with no debugger attached go on: each one polls for its
        release file while it waits (debugger.wait_for_client). One with a client attached is the
        client's to continue, and is left alone."""
        if rank is not None:
            self._check_rank(rank)
        released, attached = [], []
        for st in self.paused_workers():
            if rank is not None and st.rank != rank:
                continue
            if st.debugpy is not None and st.debugpy.client_connected:
                attached.append(st.rank)
                continue
            path = release_path(self.run_id, st.rank)
            if st.rank in self.remote_ranks:
                stacks.on_node(self._workers.node_ids[st.rank], _touch, path,
                               timeout_s=REMOTE_TIMEOUT_S * 10)
            else:
                _touch(path)
            released.append(st.rank)
        return {"released": released, "attached": attached}

    def clear_breakpoints(self) -> int:
        return sum(self._workers.control(ClearBreakpoints()))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} does not exist: this engine has ranks 0..{self.world_size - 1}")

    def close(self) -> None:
        for r in (*self.readers, *self.ledgers):
            r.close()
