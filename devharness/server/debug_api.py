"""The /debug routes (only with --debug): worker states as JSON and server-sent events, engine
pause / resume / single step, rank-aware breakpoints, any worker's stacks and logs, bundles, the KV cache map and each
request's story.

Everything that reads workers goes through the WorkerMonitor, which needs no answer from them, and what reads the
engine is answered between steps or, while a step is held up, from the view the engine loop published before it
(AsyncLLM.read), so these routes keep working while a worker is paused in a debugger or hung in a collective.
"""
from __future__ import annotations

import asyncio
import collections
import copy
import io
import tarfile
import time
from pathlib import Path
from typing import Annotated

import msgspec
from fastapi import APIRouter, Path as PathParam, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from devharness.debug.breakpoints import BreakpointSpec
from devharness.engine.async_llm import EngineBusyError
from devharness.protocol.json_codecs import engine_stats
from devharness.protocol.messages import BundleWritten, EngineStats, KvSnapshot, Snapshot
from devharness.diagnostics.stacks import StackError
from devharness.server.api import APIError

router = APIRouter(prefix="/debug", tags=["debug"])

STREAM_INTERVAL_S = 0.1       # ≥ 4 snapshots a second while anything changes
STREAM_KEEPALIVE_S = 1.0      # and one a second when nothing does


INT32_MAX = 2**31 - 1
Rank = Annotated[int, Field(ge=0, le=INT32_MAX)]
RankParam = Annotated[int, PathParam(ge=0, le=INT32_MAX)]
MAX_STEPS = 1000       # per POST /debug/engine/step: a human's single-stepping, not a run
MAX_LOG_LINES = 10_000
MAX_LEDGER_ENTRIES = 1_000_000
MAX_TIMELINE_STEPS = 1_000_000


class StepBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    n: int = Field(default=1, ge=1, le=MAX_STEPS)


class BreakBody(BaseModel):
    """Where to stop; a rank, tp or pp rank the engine lacks, a layer past the model's or a step that
    already ran is refused (400 or 404), so a breakpoint that is armed can fire."""
    model_config = ConfigDict(strict=True, extra="forbid")
    rank: Rank | None = None
    tp_rank: Rank | None = None
    pp_rank: Rank | None = None
    # 2**53: past any run's steps, and exact in the float FastAPI's schema passes bounds through
    step: int | None = Field(default=None, ge=1, le=2**53)
    request_id: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = None
    layer: Rank | None = None


class EngineRate:
    """Tokens per second over the last few seconds, from the engine's running token count."""

    def __init__(self, window_s: float = 3.0):
        self.window_s = window_s
        self.samples: collections.deque[tuple[float, int]] = collections.deque()

    def update(self, total_tokens: int) -> float:
        now = time.monotonic()
        self.samples.append((now, total_tokens))
        while len(self.samples) > 2 and now - self.samples[0][0] > self.window_s:
            self.samples.popleft()
        (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


def engine_info(request: Request) -> EngineStats:
    stats = request.app.state.llm.stats()
    state = request.app.state
    rate = getattr(state, "debug_rate", None)
    if rate is None:
        rate = state.debug_rate = EngineRate()
    tokens_per_s = round(rate.update(stats.get("num_generated_tokens_total", 0)), 2)
    return engine_stats({**stats, "tokens_per_s": tokens_per_s})


def _snapshot(request: Request) -> Snapshot:
    return request.app.state.monitor.snapshot(engine_info(request))


def _json(body) -> Response:
    """`body` (devharness.protocol.messages Structs, or builtins holding them) as JSON, encoded by msgspec."""
    return Response(msgspec.json.encode(body), media_type="application/json")


def _rank(request: Request, rank: int) -> None:
    n = request.app.state.monitor.world_size
    if not 0 <= rank < n:
        raise APIError(404, f"rank {rank} does not exist: this engine has ranks 0..{n - 1}", "rank_not_found", "rank")


@router.get("/workers")
async def workers(request: Request):
    """The engine's stats and every worker's state: a devharness.protocol.messages.Snapshot."""
    return _json(_snapshot(request))


async def _read(request: Request, fn, from_view):
    """`fn(engine)` read between steps; while a step is held up (a rank paused or hung), `from_view` of the view the
    engine loop published before it (AsyncLLM.read)."""
    try:
        return await request.app.state.llm.read(fn, from_view)
    except EngineBusyError as e:
        raise APIError(503, f"{e}; no view of the engine was published before it", "engine_busy") from None


async def _kv(request: Request) -> KvSnapshot:
    snap = await _read(request, lambda engine: engine.kv_snapshot(), lambda view: copy.copy(view.kv))
    snap.time = time.time()
    return snap


@router.get("/kv")
async def kv(request: Request):
    """The KV cache as the driver's block manager holds it: blocks free, used and cached, each block's reference
    count, hash and generation, each running or waiting request's table, and the last events (allocate, free,
    lookup, evict, preempt): a devharness.protocol.messages.KvSnapshot, read between steps."""
    return _json(await _kv(request))


@router.get("/requests")
async def requests_(request: Request):
    """Every running and waiting request (oldest first) and the last finished ones, each with its state, why it waits
    (a reason code and the numbers), its time queued, preemptions and prefix-cache hit; and the stalls the detector
    reported: a devharness.protocol.messages.RequestsSnapshot (engine/request_story.py), read between steps."""
    llm = request.app.state.llm
    paused = llm.paused
    return _json(await _read(request, lambda engine: engine.requests_snapshot(paused), lambda view: view.requests))


@router.get("/requests/{request_id}")
async def request_story(request: Request, request_id: str):
    """One request's story: arrival, the steps it was passed over and why, prefill chunks, preemptions, first token,
    end (a devharness.protocol.messages.RequestStory with its events)."""
    llm = request.app.state.llm
    paused = llm.paused
    story = await _read(request, lambda engine: engine.request_story(request_id, paused),
                        lambda view: view.stories.get(request_id))
    if story is None:
        raise APIError(404, f"no request {request_id!r} is running or waiting, nor among the last finished",
                       "request_not_found", "request_id")
    return _json(story)


@router.get("/stream")
async def stream(request: Request, kv: bool = False):
    """The /debug/workers Snapshot as server-sent events, on change (its time aside) and once a second; with
    `?kv=1`, each carries the /debug/kv map too."""
    async def events():
        last_key, last_sent = None, 0.0
        while not await request.is_disconnected():
            snap = _snapshot(request)
            if kv:
                snap.kv = await _kv(request)
            key = msgspec.json.encode((snap.engine, snap.workers, snap.kv and (snap.kv.step, snap.kv.events,
                                                                                  snap.kv.ref_counts)))
            now = time.monotonic()
            if key != last_key or now - last_sent >= STREAM_KEEPALIVE_S:
                yield b"data: " + msgspec.json.encode(snap) + b"\n\n"
                last_key, last_sent = key, now
            if snap.engine.state in ("stopped", "dead"):
                return      # the server is going away: let uvicorn finish
            await asyncio.sleep(STREAM_INTERVAL_S)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.post("/engine/pause")
async def pause(request: Request):
    await request.app.state.llm.pause()
    return _json({"engine": engine_info(request)})


@router.post("/engine/resume")
async def resume(request: Request):
    await request.app.state.llm.resume()
    return _json({"engine": engine_info(request)})


@router.post("/engine/step")
async def step(request: Request, body: StepBody | None = None):
    """Run `n` steps, pausing the engine first if it runs; it stays paused (the reply says so) until /resume."""
    n = body.n if body is not None else 1
    llm = request.app.state.llm
    was_running = not llm.paused
    await llm.step_once(n)
    how = "it was running: this paused it, and it" if was_running else "it"
    return _json({"engine": engine_info(request), "steps": n, "state": "paused", "paused_by_step": was_running,
                  "message": f"ran {n} step(s); {how} stays paused until POST /debug/engine/resume"})


@router.post("/break")
async def arm_break(request: Request, body: BreakBody | None = None):
    spec = BreakpointSpec(**(body.model_dump() if body is not None else {}))
    monitor = request.app.state.monitor
    if spec.rank is not None:
        _rank(request, spec.rank)
    num_layers = request.app.state.llm.engine.source.arch.num_hidden_layers
    if spec.layer is not None and spec.layer >= num_layers:
        raise APIError(400, f"layer {spec.layer} does not exist: the model has layers 0..{num_layers - 1}",
                       "invalid_value", "layer")
    step = request.app.state.llm.stats().get("step", 0)
    if spec.step is not None and spec.step <= step:
        raise APIError(400, f"step {spec.step} has already run (the engine is at step {step}): "
                       f"pick a later one, or none for the next", "invalid_value", "step")
    try:
        # Arming talks to the workers; never on the event loop.
        ranks = await asyncio.to_thread(monitor.arm_breakpoint, spec)
    except ValueError as e:
        raise APIError(400, str(e), "no_matching_worker") from None
    return {"armed": ranks, "breakpoint": body.model_dump(exclude_none=True) if body is not None else {}}


class ReleaseBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    rank: Rank | None = None


@router.post("/release")
async def release(request: Request, body: ReleaseBody | None = None):
    """Continue every rank (or `rank`) paused at a breakpoint or post-mortem with no debugger attached."""
    rank = body.rank if body is not None else None
    if rank is not None:
        _rank(request, rank)
    return await asyncio.to_thread(request.app.state.monitor.release, rank)


@router.delete("/break")
async def clear_breaks(request: Request):
    cleared = await asyncio.to_thread(request.app.state.monitor.clear_breakpoints)
    return {"cleared": cleared}


@router.get("/workers/{rank}/stack")
async def stack(request: Request, rank: RankParam):
    _rank(request, rank)
    try:
        return await asyncio.to_thread(request.app.state.monitor.stack, rank)
    except StackError as e:
        raise APIError(503, str(e), "stack_unavailable") from None


@router.get("/workers/{rank}/logs")
async def logs(request: Request, rank: RankParam,
               lines: Annotated[int, Query(ge=1, le=MAX_LOG_LINES)] = 200):
    """The last `lines` lines the worker printed or logged (read from its log file, not asked of it)."""
    _rank(request, rank)
    try:
        return {"rank": rank, "lines": await asyncio.to_thread(request.app.state.monitor.logs, rank, lines)}
    except StackError as e:
        raise APIError(503, str(e), "logs_unavailable") from None


@router.get("/workers/{rank}/history")
async def history(request: Request, rank: RankParam):
    """That worker's last steps, oldest first: devharness.protocol.messages.StepRecord objects."""
    _rank(request, rank)
    return _json({"rank": rank, "steps": request.app.state.monitor.history(rank)})


@router.get("/workers/{rank}/collectives")
async def collectives(request: Request, rank: RankParam,
                      last: Annotated[int | None, Query(ge=1, le=MAX_LEDGER_ENTRIES)] = None):
    """That worker's collective ledger (its newest `last` entries, oldest first): a devharness.protocol.messages.Ledger,
    read from its shared memory (it answers while the worker is paused or hung)."""
    _rank(request, rank)
    return _json(await asyncio.to_thread(request.app.state.monitor.collectives, rank, last))


@router.get("/driver")
async def driver(request: Request, steps: Annotated[int | None, Query(ge=1, le=MAX_TIMELINE_STEPS)] = None):
    """The driver's side of the last `steps` steps (all it keeps by default: when each was scheduled, sent, done and
    applied, each request's tokens) and the stories of the requests it holds: a
    devharness.protocol.messages.DriverTimeline, read between steps (devharness trace's driver process)."""
    return _json(await request.app.state.llm.inspect(lambda engine: engine.driver_timeline(steps)))


@router.get("/timeline")
async def timeline(request: Request, steps: Annotated[int | None, Query(ge=1, le=MAX_TIMELINE_STEPS)] = None):
    """Where the last `steps` steps' time went (all the ranks' histories hold by default): diagnostics/timeline.py's
    answers, from every rank's ledger and history as the workers published them."""
    from devharness.diagnostics.timeline import align, answers
    monitor = request.app.state.monitor

    def read() -> dict:
        ranks = range(monitor.world_size)
        return answers(*align({r: monitor.collectives(r) for r in ranks}, {r: monitor.history(r) for r in ranks},
                              monitor.clock_offsets_ns), steps)
    return _json(await asyncio.to_thread(read))


@router.post("/bundle")
async def write_bundle(request: Request):
    """Write a bundle now (diagnostics/bundle.py); where it is on the server, and its name for GET /debug/bundle/NAME."""
    runner = request.app.state.llm.runner
    path = Path(await asyncio.to_thread(runner.write_bundle, "requested"))
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    return _json(BundleWritten(path=str(path), name=path.name, files=files))


@router.get("/bundle/{name}")
async def fetch_bundle(request: Request, name: str):
    """A bundle this server wrote, as a .tar.gz (for `devharness bundle --url URL --out DIR` on another machine)."""
    paths = {p.name: p for p in request.app.state.llm.runner.bundles.paths}
    if name not in paths:
        raise APIError(404, f"no bundle named {name!r} was written by this server", "bundle_not_found", "name")

    def pack() -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            tar.add(paths[name], arcname=name)
        return buf.getvalue()
    return Response(await asyncio.to_thread(pack), media_type="application/gzip",
                    headers={"Content-Disposition": f'attachment; filename="{name}.tar.gz"'})
