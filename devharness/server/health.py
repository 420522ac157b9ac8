"""GET /health: 200 only while the engine serves; otherwise 503 saying why (OpenAI's error shape, with
the reason as its code and the details beside it; while the workers restart, with Retry-After).

Cheap checks come first and need no answer from the engine thread: a rank paused at a breakpoint
holds the step, so a ping through the engine would only wait out its timeout.
"""
from __future__ import annotations

import asyncio
import time

from devharness.engine.async_llm import AsyncLLM, EngineDeadError, EngineRestartingError


async def health_problem(llm: AsyncLLM, monitor) -> tuple[str, str, dict] | None:
    """None while the engine serves; else (reason, one-line message, details)."""
    if llm.dead_error is not None:
        return "engine_dead", str(llm.dead_error), {}
    if llm.restarting:
        return _restarting(llm)
    if monitor is not None:
        paused = await asyncio.to_thread(monitor.paused_workers)
        if paused:
            where = [{"rank": st.rank, "tp_rank": st.tp_rank, "pp_rank": st.pp_rank, "reason": st.paused.reason,
                      "file": st.paused.file, "line": st.paused.line, "since": st.paused.since,
                      "debugger_attached": bool(st.debugpy and st.debugpy.client_connected)} for st in paused]
            text = "; ".join(f"rank {w['rank']} is paused ({w['reason']}) at {w['file']}:{w['line']}" for w in where)
            return "rank_paused", f"{text}; POST /debug/release lets a rank with no debugger attached go on", \
                {"paused": where}
    if llm.paused:
        return "engine_paused", "the engine is paused by a user (POST /debug/engine/resume)", {}
    running = llm.step_running_s()
    if running is not None:
        return _overdue(llm, running)   # None while busy: a step in progress finds a dead worker itself
    try:
        await llm.check_health()
    except EngineRestartingError:
        return _restarting(llm)
    except EngineDeadError as e:
        return "engine_dead", str(e), {}
    return None


def _overdue(llm: AsyncLLM, running: float) -> tuple[str, str, dict] | None:
    """A running step is overdue once the hang detector names a rank holding it up (after --hang-after: stopped,
    hung, dead...), or past the step timeout; `overdue` names the step and those ranks."""
    limit = llm.engine.config.parallel.step_timeout_s
    hang = llm.runner.current_hang()
    if hang is None and running <= limit:
        return None
    step = hang.step if hang is not None else llm.stats().get("step", 0) + 1
    past = f", past the step timeout of {limit:.0f} s" if running > limit else ""
    text = f"step {step} has run {running:.0f} s{past}" + (f"; {hang.describe()}" if hang is not None else "")
    overdue = {"step": step, "running_s": round(running, 1),
               "ranks": [] if hang is None else [{"rank": b.rank, "why": b.why} for b in hang.missing],
               "hang": None if hang is None else hang.describe()}
    return "step_overdue", text, {"step": step, "running_s": overdue["running_s"], "overdue": overdue}


def _restarting(llm: AsyncLLM) -> tuple[str, str, dict]:
    return "restarting", llm.restarting_message(), {"retry_after_s": llm.retry_after_s()}


def health_headers(body: dict) -> dict[str, str] | None:
    """Retry-After while the workers restart."""
    return {"Retry-After": str(body["retry_after_s"])} if "retry_after_s" in body else None


def health_body(problem: tuple[str, str, dict] | None, llm: AsyncLLM) -> tuple[int, dict]:
    if problem is None:
        stats = llm.stats()
        return 200, {"status": "ok", "state": stats["state"], "restarts": stats["restarts"],
                     "last_restart": stats["last_restart"]}
    reason, message, details = problem
    return 503, {"error": {"message": message, "type": "server_error", "code": reason, "param": None},
                 "status": "unavailable", "reason": reason, "time": time.time(), **details}
