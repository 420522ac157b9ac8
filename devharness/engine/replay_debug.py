"""`devharness replay DIR --debug --break-at-step N [--break-rank R]`: a replay with every worker a debugpy
listener (host:port_base + rank, as `serve --debug`), and rank R stopped at step N in the breakpoint
`POST /debug/break` arms (ArmBreakpoint, debug/breakpoints.py): it waits for a debugger in the model
runner's frame, with the step message `so` in scope, and the replay goes on when the debugger continues.

N is a recorded step number, the step message's `SchedulerOutput.step`, not a position: a flight-recorder
bundle holds only the last steps of a run, and its first step keeps the number it had in that run.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from devharness.config import DebugConfig
from devharness.protocol.messages import ArmBreakpoint, BreakpointSpec


@dataclass(frozen=True)
class ReplayBreak:
    """Where a debug replay stops: rank `rank` at recorded step `step`, waiting on host:port."""

    step: int
    rank: int
    host: str
    port: int

    def announcement(self) -> str:
        return (f"replay: rank {self.rank} will stop at step {self.step} and wait for a debugger: "
                f"attach to {self.host}:{self.port} (VS Code: Python Debugger, attach, that port); "
                f"the replay goes on when it continues")


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "no steps"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}..{steps[-1]}"
    return "steps " + ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")


def plan(debug: bool | DebugConfig, break_at_step: int | None, break_rank: int | None,
         recorded_steps: list[int], world_size: int,
         debug_api_port: int | None = None, debug_api=None) -> tuple[DebugConfig, ReplayBreak | None]:
    """The replay's DebugConfig and its breakpoint, checked against the recording's step numbers and the
    replay's ranks before any worker starts. A bad combination is a ValueError in one sentence."""
    dbg = debug if isinstance(debug, DebugConfig) else DebugConfig(enabled=bool(debug))
    _check_debug_api_port(dbg, debug_api_port, debug_api)
    if break_at_step is None:
        if break_rank is not None:
            raise ValueError(f"--break-rank {break_rank} (break_rank) needs --break-at-step N (break_at_step)")
        return dbg, None
    if not dbg.enabled:
        raise ValueError(f"--break-at-step {break_at_step} (break_at_step) needs --debug (debug=True): "
                         f"the breakpoint waits for a debugger")
    if isinstance(break_at_step, bool) or not isinstance(break_at_step, int) or break_at_step not in recorded_steps:
        raise ValueError(f"--break-at-step {break_at_step} (break_at_step): the recording holds "
                         f"{_steps_text(recorded_steps)} (a step number is SchedulerOutput.step)")
    rank = 0 if break_rank is None else break_rank
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"--break-rank {rank} (break_rank): this replay has ranks 0..{world_size - 1}")
    return dbg, ReplayBreak(break_at_step, rank, dbg.host, dbg.port_base + rank)


def _check_debug_api_port(debug: DebugConfig, port: int | None, debug_api) -> None:
    if port is None:
        return
    if not debug.enabled:
        raise ValueError(f"--port {port} (debug_api_port) needs --debug (debug=True): it serves the debug API")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port {port} (debug_api_port): must be a TCP port in 0..65535 (0 picks a free one)")
    if debug_api is None:
        raise ValueError(f"debug_api_port={port} needs debug_api, what serves it (the engine serves no HTTP): "
                         f"pass devharness.server.replay_api.ReplayDebugServer")


class Session:
    """What a debug replay adds around its steps: the debug API (`port`, served by `debug_api(core, port)`, an
    object with `url` and `close()`: server/replay_api.py's ReplayDebugServer), then the armed breakpoint.
    Messages go to stderr (`out`): the verdict keeps stdout."""

    def __init__(self, brk: ReplayBreak | None, debug_api_port: int | None = None, out=None, debug_api=None):
        self.brk, self.port, self.out, self.debug_api = brk, debug_api_port, out, debug_api
        self.server = None

    def start(self, core) -> None:
        dbg = core.config.debug
        if dbg.enabled and not dbg.host_is_loopback:
            self._say(f"replay: warning: debug listeners bind {dbg.host}: anyone who reaches ports "
                      f"{dbg.port_base}.. can run any code in the workers")
        if dbg.enabled:
            ranks = range(core.config.parallel.world_size)
            self._say("replay: debugpy listeners: " + ", ".join(f"rank {r} {dbg.host}:{dbg.port_base + r}"
                                                                 for r in ranks))
        if self.port is not None:
            self.server = self.debug_api(core, self.port)
            self._say(f"replay: debug API at {self.server.url} (live view: devharness tui --url {self.server.url})")
        if self.brk is not None:
            arm(core.executor, self.brk)
            self._say(self.brk.announcement())

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def _say(self, line: str) -> None:
        print(line, file=self.out or sys.stderr, flush=True)


def arm(executor, brk: ReplayBreak) -> None:
    """Arm the breakpoint on its rank (the ArmBreakpoint control call, as POST /debug/break)."""
    kept = executor.control(ArmBreakpoint(BreakpointSpec(rank=brk.rank, step=brk.step)), [brk.rank])
    assert kept == [True], f"rank {brk.rank} refused a breakpoint naming it: {kept}"
