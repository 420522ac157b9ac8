"""The /debug routes that only read workers (states, stream, stacks, logs, histories) plus release, served
over a replay (`devharness replay DIR --debug --port P`), so `devharness tui --url` shows the replay's
ranks, the one paused at --break-at-step included. The routes are server/debug_api.py's own; a replay has
no scheduler, so the engine-control routes (pause, resume, step, break) are left out."""
from __future__ import annotations

import socket
import threading

import uvicorn
from fastapi import APIRouter, FastAPI

from devharness.config import REQUEST_HEADERS_S
from devharness.diagnostics.workers import WorkerMonitor
from devharness.server import debug_api
from devharness.server.app import uvicorn_config
from devharness.server.errors import install_error_handlers

LOOPBACK = "127.0.0.1"   # no authentication here: loopback only, as `serve`'s default


def _replay_routes() -> APIRouter:
    router = APIRouter()
    router.routes.extend(r for r in debug_api.router.routes
                         if ("GET" in getattr(r, "methods", ()) and not r.path.startswith("/debug/bundle"))
                         or r.path == "/debug/release")
    return router


class _ReplayEngine:
    """What the /debug routes read of an engine, for a replay: its config and workers (WorkerMonitor),
    and stats() (debug_api.engine_info): the step the workers are at, and whether the replay goes on."""

    def __init__(self, core):
        self.config = core.config
        self.workers = core.executor
        self.monitor: WorkerMonitor | None = None
        self.stopped = False

    def stats(self) -> dict:
        states = self.monitor.workers() if self.monitor is not None else []
        return {"step": max((w.step for w in states), default=0),
                "state": "stopped" if self.stopped else "running",
                "kv_blocks_total": self.config.scheduler.num_kv_blocks or 0}


class ReplayDebugServer:
    """uvicorn in a daemon thread over one replay's workers; `close()` ends the stream and the server."""

    def __init__(self, core, port: int, header_timeout_s: float = REQUEST_HEADERS_S):
        try:
            self.sock = socket.create_server((LOOPBACK, port))
        except OSError as e:
            raise ValueError(f"--port {port}: cannot listen on {LOOPBACK}:{port}: {e.strerror or e}") from None
        self.engine = _ReplayEngine(core)
        self.engine.monitor = WorkerMonitor(self.engine)
        app = FastAPI(title="devharness replay")
        app.state.llm = self.engine
        app.state.monitor = self.engine.monitor
        install_error_handlers(app)
        app.include_router(_replay_routes())
        # As serve's: a client whose request headers stop coming does not hold a connection.
        self.server = uvicorn.Server(uvicorn_config(app, header_timeout_s, timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="replay-debug-api", daemon=True)
        self.thread.start()
        self.url = f"http://{LOOPBACK}:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.engine.stopped = True          # open /debug/stream responses end on "stopped"
        self.server.should_exit = True
        self.thread.join(5)
        self.engine.monitor.close()
        self.sock.close()
