"""The driver's view of every worker: published states, step histories, stacks, breakpoints.

Everything here works while a worker is paused or hung: states and histories are read from the
workers' shared-memory files, stacks through py-spy. Only arming a breakpoint talks to workers.
"""
from __future__ import annotations

import os
import time

import msgspec

from devharness.debug import probes
from devharness.debug.breakpoints import BreakpointSpec
from devharness.debug.state import StateReader, WorkerState

LOCAL_IPS = {"127.0.0.1", "localhost"}


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
    except OSError:
        return True


class DebugHub:
    """Reads the workers of one engine; `snapshot()` is the /debug/workers document."""

    def __init__(self, engine):
        self.engine = engine
        cfg = engine.config
        self.run_id = cfg.run_id
        self.world_size = cfg.parallel.world_size
        self.tp_size = cfg.parallel.tensor_parallel_size
        self.readers = [StateReader(self.run_id, r) for r in range(self.world_size)]
        self._local_ips = set(LOCAL_IPS)
        try:
            import ray
            if ray.is_initialized():
                self._local_ips.add(ray.util.get_node_ip_address())
        except Exception:
            pass
        self._last_known: dict[int, WorkerState] = {}

    def _placeholder(self, rank: int) -> WorkerState:
        return WorkerState(rank=rank, tp_rank=rank % self.tp_size, pp_rank=rank // self.tp_size, node_ip="",
                           pid=0, phase="idle", detail="starting", alive=True)

    def worker_state(self, rank: int) -> WorkerState:
        st = self.readers[rank].state()
        if st is None:
            st = self._last_known.get(rank) or self._placeholder(rank)
        else:
            self._last_known[rank] = st
        if st.pid and self.is_local(st) and not _pid_alive(st.pid):
            st = msgspec.structs.replace(st, alive=False, phase="dead", detail=f"process {st.pid} is gone")
        return st

    def is_local(self, st: WorkerState) -> bool:
        return st.node_ip in self._local_ips or not st.node_ip

    def workers(self) -> list[dict]:
        return [msgspec.to_builtins(self.worker_state(r)) for r in range(self.world_size)]

    def snapshot(self, engine_info: dict) -> dict:
        return {"engine": engine_info, "workers": self.workers(), "time": time.time()}

    def history(self, rank: int) -> list[dict]:
        self._check_rank(rank)
        return msgspec.to_builtins(self.readers[rank].history())

    def stack(self, rank: int) -> dict:
        """Every thread's Python stack of that worker, read from outside (works while paused or hung)."""
        self._check_rank(rank)
        st = self.worker_state(rank)
        if not st.pid:
            raise probes.ProbeError(f"rank {rank} has not started yet")
        if not st.alive:
            raise probes.ProbeError(f"rank {rank} (pid {st.pid}) is dead")
        if self.is_local(st):
            text = probes.dump_stacks(st.pid)
        else:
            import ray
            text = probes.dump_stacks_via_ray(ray.get_runtime_context().get_dashboard_url() or "",
                                              st.node_ip, st.pid)
        return {"rank": rank, "pid": st.pid, "node_ip": st.node_ip, "stacks": text}

    def arm_breakpoint(self, spec: BreakpointSpec) -> list[int]:
        """Arm `spec` on the workers it names; returns their ranks."""
        ranks = [r for r in range(self.world_size)
                 if spec.matches_worker(self._placeholder(r))]
        if not ranks:
            raise ValueError(f"no worker matches {msgspec.to_builtins(spec)} "
                             f"(ranks 0..{self.world_size - 1}, tp size {self.tp_size})")
        self.engine.core.executor.collective_rpc("arm_breakpoint", (msgspec.to_builtins(spec),), ranks)
        return ranks

    def clear_breakpoints(self) -> int:
        return sum(self.engine.core.executor.collective_rpc("clear_breakpoints"))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} does not exist: this engine has ranks 0..{self.world_size - 1}")

    def close(self) -> None:
        for r in self.readers:
            r.close()
