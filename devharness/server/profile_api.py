"""`POST /start_profile` and `POST /stop_profile`, vLLM's names: the workers' profiler (debug/profiler.py) over the
steps between the two, by default a torch profile writing one Chrome trace per rank into the server's
--profiler-dir. Offered only with --debug or --profiler-dir; the debug token guards them where it guards /debug."""
from __future__ import annotations

from typing import Annotated

import msgspec
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StringConstraints

from devharness.engine.async_llm import EngineBusyError
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
    paused or hung), a 503, and `fn` does not run later either (AsyncLLM.inspect withdraws it)."""
    try:
        return await request.app.state.llm.inspect(fn, timeout_s=ENGINE_WAIT_S)
    except EngineBusyError as e:
        raise APIError(503, f"{e}; nothing was changed", "engine_busy") from None


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
