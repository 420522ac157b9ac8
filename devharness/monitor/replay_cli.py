"""`devharness replay DIR|BUNDLE`'s command line: its debug flags (`--debug --break-at-step N [--break-rank R]
[--port P]`, engine/replay_debug.py), the replay it runs (engine/replay.py) with, on --port, the read-only debug
API served (server/replay_api.py), and its verdict printed."""
from __future__ import annotations

import argparse
import json

from devharness.config import DebugConfig


def replay_main(args) -> int:
    from devharness.engine.replay import replay
    result = replay(args.directory, args.tp, args.pp, args.executor, args.model, args.threads_per_worker, args.inject,
                    kernels=args.kernels, **from_cli_args(args))
    if args.json:
        d = result.difference
        print(json.dumps({"ok": result.ok, "num_steps": result.num_steps, "total_steps": result.total_steps,
                          "layout": result.layout, "difference": None if d is None else vars(d),
                          "last_step": result.last_step, "recorded_error": result.recorded_error,
                          "recorded_error_kind": result.recorded_error_kind,
                          "error": result.error, "max_digest_diff": result.max_digest_diff,
                          "kernels": result.kernels, "recorded_kernels": result.recorded_kernels,
                          "weights": result.weights, "recorded_weights": result.recorded_weights,
                          "verdict": result.verdict()}))
    else:
        print(result.verdict())
    return 0 if result.ok else 1


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from devharness.engine.args import add_option_flags
    g = parser.add_argument_group("debugging a replay")
    add_option_flags(g, ["enabled", "host", "port_base"])
    g.add_argument("--break-at-step", type=int, default=None, metavar="N",
                   help="with --debug: stop rank --break-rank at the recorded step N (its SchedulerOutput.step, "
                        "as the step-differs verdict names it; a bundle's steps start where its window does) "
                        "and wait for a debugger; the replay goes on when it continues")
    g.add_argument("--break-rank", type=int, default=None, metavar="R", help="the rank that stops (default 0)")
    g.add_argument("--port", type=int, default=None, metavar="P",
                   help="with --debug: serve the read-only debug API on 127.0.0.1:P while replaying, for "
                        "`devharness tui --url` (0 picks a free port)")


def from_cli_args(ns: argparse.Namespace) -> dict:
    """`replay(...)`'s debug keyword arguments from the parsed flags."""
    debug: bool | DebugConfig = False
    if ns.debug:
        debug = DebugConfig(enabled=True, host=ns.debug_host, port_base=ns.debug_port_base)
    kwargs = {"debug": debug, "break_at_step": ns.break_at_step, "break_rank": ns.break_rank,
              "debug_api_port": ns.port}
    if ns.port is not None:   # the server side (FastAPI, uvicorn) loads only when asked for
        from devharness.server.replay_api import ReplayDebugServer
        kwargs["debug_api"] = ReplayDebugServer
    return kwargs
