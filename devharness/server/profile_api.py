"""`POST /start_profile` and `POST /stop_profile`, vLLM's names: the workers' profiler (debug/profiler.py) over the
steps between the two, by default a torch profile writing one Chrome trace per rank into the server's
--profiler-dir. Offered only with --debug or --profiler-dir; the debug token guards them where it guards /debug."""
from __future__ import annotations

import threading
from typing import Annotated

import msgspec
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StringConstraints

from devharness.server.api import APIError

ENGINE_WAIT_S = 30.0   # for the engine thread to come between steps

router = APIRouter(tags=["profile"])


class StartProfileBody(BaseModel):
    """Which profiler (debug/profiler.py): "torch" (the default), "state-ab", "ledger-ab" or "recorder-calls". A torch
    profile's traces go to the server's --profiler-dir (default <tempdir>/devharness-profiles), never elsewhere."""
    model_config = ConfigDict(strict=True, extra="forbid")
    kind: Annotated[str, StringConstraints(min_length=1, max_length=64)] = "torch"


async def _between_steps(request: Request, fn):
    """`fn(engine)` on the engine thread between steps. When that thread does not come (a step held up by a rank
    paused or hung), a 503, and `fn` does not run later either."""
    lock, state = threading.Lock(), {"claimed": False, "given_up": False}

    def once(engine):
        with lock:   # inspect runs `once` here, in the event loop, when it gave up waiting: then never again
            if state["given_up"] or state["claimed"] or _in_event_loop():
                state["given_up"] = True
                raise APIError(503, f"the engine did not come between steps within {ENGINE_WAIT_S:.0f} s (a step is "
                               "held up: a rank paused or hung); nothing was changed", "engine_busy")
            state["claimed"] = True
        return fn(engine)

    return await request.app.state.llm.inspect(once, timeout_s=ENGINE_WAIT_S)


def _in_event_loop() -> bool:
    import asyncio
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


@router.post("/start_profile")
async def start_profile(request: Request, body: StartProfileBody | None = None):
    kind = body.kind if body is not None else "torch"

    def start(engine):
        if engine.profile_kind is not None:
            raise APIError(409, f"a {engine.profile_kind!r} profile is running: POST /stop_profile first",
                           "profile_running")
        try:
            engine.start_profile(kind)
        except ValueError as e:
            raise APIError(400, str(e), "invalid_value", "kind") from None

    await _between_steps(request, start)
    return {"profiling": kind}


@router.post("/stop_profile")
async def stop_profile(request: Request):
    """What each rank measured, in rank order (ProfileResult; a torch profile: `trace`, the file it wrote)."""
    def stop(engine):
        if engine.profile_kind is None:
            raise APIError(409, "no profile is running: POST /start_profile first", "no_profile")
        return engine.stop_profile()

    return {"results": msgspec.to_builtins(await _between_steps(request, stop))}
