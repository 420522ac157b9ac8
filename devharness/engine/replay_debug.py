"""`devharness replay DIR --debug --break-at-step N [--break-rank R]`: a replay with every worker a debugpy
listener (host:port_base + rank, as `serve --debug`), and rank R stopped at step N in the breakpoint
`POST /debug/break` arms (ArmBreakpoint, debug/breakpoints.py): it waits for a debugger in the model
runner's frame, with the step message `so` in scope, and the replay goes on when the debugger continues.

N is a recorded step number, the step message's `SchedulerOutput.step`, not a position: a flight-recorder
bundle holds only the last steps of a run, and its first step keeps the number it had in that run.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from devharness.config import DebugConfig
from devharness.messages import ArmBreakpoint, BreakpointSpec


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
         recorded_steps: list[int], world_size: int) -> tuple[DebugConfig, ReplayBreak | None]:
    """The replay's DebugConfig and its breakpoint, checked against the recording's step numbers and the
    replay's ranks before any worker starts. A bad combination is a ValueError in one sentence."""
    dbg = debug if isinstance(debug, DebugConfig) else DebugConfig(enabled=bool(debug))
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


def arm(executor, brk: ReplayBreak, out=None) -> None:
    """Arm the breakpoint on its rank, then say where to attach (stderr; the verdict keeps stdout)."""
    kept = executor.control(ArmBreakpoint(BreakpointSpec(rank=brk.rank, step=brk.step)), [brk.rank])
    assert kept == [True], f"rank {brk.rank} refused a breakpoint naming it: {kept}"
    print(brk.announcement(), file=out or sys.stderr, flush=True)


# -- the command line: `devharness replay`'s debug flags --------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("debugging a replay")
    g.add_argument("--debug", action="store_true", help="debugpy in every worker (rank r on base + r), long timeouts")
    g.add_argument("--debug-host", default="127.0.0.1",
                   help="where debug listeners bind; anything but loopback lets others run code in the workers")
    g.add_argument("--debug-port-base", type=int, default=5678, help="rank r listens on base + r")
    g.add_argument("--break-at-step", type=int, default=None, metavar="N",
                   help="with --debug: stop rank --break-rank at the recorded step N (its SchedulerOutput.step, "
                        "as the step-differs verdict names it; a bundle's steps start where its window does) "
                        "and wait for a debugger; the replay goes on when it continues")
    g.add_argument("--break-rank", type=int, default=None, metavar="R", help="the rank that stops (default 0)")


def from_cli_args(ns: argparse.Namespace) -> dict:
    """`replay(...)`'s debug keyword arguments from the parsed flags."""
    debug: bool | DebugConfig = False
    if ns.debug:
        debug = DebugConfig(enabled=True, host=ns.debug_host, port_base=ns.debug_port_base)
    return {"debug": debug, "break_at_step": ns.break_at_step, "break_rank": ns.break_rank}
