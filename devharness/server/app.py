"""The server app (`build_app`) and `devharness serve` (`serve_main`): uvicorn in the main thread,
the engine loop in its own (AsyncLLM). Errors always leave in OpenAI's shape, never FastAPI's
{"detail": ...}; a bad request is a 4xx and the server keeps serving the others."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from devharness.config import MAX_PENDING_REQUESTS, REQUEST_BODY_IDLE_S, REQUEST_BODY_TOTAL_S, REQUEST_HEADERS_S
from devharness.debug.redact import add_secret
from devharness.engine.args import EngineArgs
from devharness.engine.async_llm import AsyncLLM
from devharness.server import api
from devharness.server.auth import BearerAuth, ServerAuth, is_loopback
from devharness.server.errors import BodySizeLimit, document_errors, install_error_handlers
from devharness.server.health import health_body, health_headers, health_problem
from devharness.server.metrics import ServerMetrics
from devharness.server.starting import StartupResponder
from devharness.server.timeouts import BodyTimeout, header_timeout_protocol

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024   # a whole max_model_len of token ids fits many times over
# Long enough for in-flight responses to send their error event, short enough that Ctrl-C is prompt.
GRACEFUL_SHUTDOWN_S = 10
# --api-key's and --debug-token's values from the environment, off the command line (and `ps`).
SECRET_ENV = ("DEVHARNESS_API_KEY", "DEVHARNESS_DEBUG_TOKEN")
BACKLOG = 2048   # uvicorn's default, which it sets again when it takes the socket over


def build_app(llm: AsyncLLM, monitor=None, *, host: str = "127.0.0.1", api_key: str | None = None,
              debug_token: str | None = None,
              max_pending_requests: int = MAX_PENDING_REQUESTS, body_idle_s: float = REQUEST_BODY_IDLE_S,
              body_total_s: float = REQUEST_BODY_TOTAL_S) -> FastAPI:
    """The OpenAI routes, /health and /metrics over `llm`; with a debug monitor, the /debug routes too.
    `host` is the address the server binds: off loopback the /debug routes always need a token
    (`debug_token`, else a generated one: app.state.auth.debug_token). A request body that stops coming for
    `body_idle_s`, or is not all in after `body_total_s`, is a 408."""
    if isinstance(max_pending_requests, bool) or not isinstance(max_pending_requests, int) \
            or max_pending_requests < 1:
        raise ValueError(f"--max-pending-requests {max_pending_requests!r}: must be an integer >= 1")
    BodyTimeout.check(body_idle_s, body_total_s)
    app = FastAPI(title="devharness", summary="OpenAI-compatible server of a debuggable inference engine")
    app.state.llm = llm
    app.state.metrics = ServerMetrics(llm)
    app.state.monitor = monitor
    app.state.max_pending_requests = max_pending_requests
    app.state.auth = auth = ServerAuth.for_bind(host, monitor is not None, api_key, debug_token)
    for secret in (auth.api_key, auth.debug_token):   # masked in stacks, logs and bundles from now on
        add_secret(secret)
    app.add_middleware(BodyTimeout, idle_s=body_idle_s, total_s=body_total_s)
    app.add_middleware(BodySizeLimit, max_bytes=MAX_BODY_BYTES)
    if auth.guards():   # added last, so it runs first: a stranger's request is refused before its body is read
        app.add_middleware(BearerAuth, guards=auth.guards())
    install_error_handlers(app)
    document_errors(app, guarded=tuple(auth.guards()))
    app.include_router(api.router)

    @app.get("/health")
    async def health():
        """200 while the engine serves; 503 with the reason: dead, restarting, a rank paused, paused, a step overdue."""
        status, body = health_body(await health_problem(llm, app.state.monitor), llm)
        return JSONResponse(body, status, headers=health_headers(body))

    @app.get("/metrics")
    async def metrics():
        m: ServerMetrics = app.state.metrics
        # A scrape reads every rank's ledger: off the event loop.
        return Response(await asyncio.to_thread(m.render), media_type=m.content_type)

    if monitor is not None:
        from devharness.server.debug_api import router as debug_router
        app.include_router(debug_router)
    if monitor is not None or llm.engine.config.profiler_dir:
        from devharness.server.profile_api import router as profile_router
        app.include_router(profile_router)
    return app


# -- `devharness serve` ---------------------------------------------------------------------------------

def serve_main(args) -> int:
    ServerAuth.for_bind(args.host, args.debug, args.api_key, args.debug_token)   # bad tokens fail now
    for secret in (args.api_key, args.debug_token):
        add_secret(secret)
    # Read (cli.py's defaults): the workers started next, processes or Ray actors, need neither.
    for name in SECRET_ENV:
        os.environ.pop(name, None)
    # The port is bound and listening before anything else starts: a free port a script picked cannot be taken by
    # the run's own connections while the model loads (gloo, debugpy, Ray), and a busy one fails now. Python's
    # sockets are close-on-exec, mp workers come from a forkserver started by exec and Ray's processes from
    # subprocess: none of them holds the listener. Until uvicorn takes over, a tiny responder answers 503.
    with _listen(args.host, args.port) as sock, contextlib.closing(StartupResponder(sock)) as starting:
        llm = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args))
        try:
            monitor = None
            if llm.engine.config.debug.enabled:
                from devharness.diagnostics.workers import WorkerMonitor
                monitor = WorkerMonitor(llm.engine)
            app = build_app(llm, monitor, host=sock.getsockname()[0], api_key=args.api_key,
                            debug_token=args.debug_token, max_pending_requests=args.max_pending_requests)
            config = uvicorn_config(app, backlog=BACKLOG, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
            # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers in
            # place that is a no-op, so the engine's workers are shut down below instead of the process
            # dying (SIGTERM's default) or unwinding with a KeyboardInterrupt traceback.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: None)
            _Server(config, llm, sock, app.state.auth, starting).run(sockets=[sock])
        finally:
            llm.shutdown()
    print("devharness: server stopped", flush=True)
    # The process ends next, with workers, files and sockets already released: spare it the interpreter's
    # last collection over every object torch and the app made (seconds on a busy machine, past the
    # promptness a Ctrl-C is owed).
    gc.freeze()
    return 0


def uvicorn_config(app: FastAPI, header_timeout_s: float = REQUEST_HEADERS_S, **settings) -> uvicorn.Config:
    """uvicorn's settings for `app`: h11, closing a connection whose request headers stall (server/timeouts.py)."""
    return uvicorn.Config(app, http=header_timeout_protocol(header_timeout_s), log_level="warning", lifespan="off",
                          **settings)


def _listen(host: str, port: int) -> socket.socket:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: must be a TCP port in 0..65535 (0 picks a free one)")
    sock = None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port or --host") from None
    return sock


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn.Server that announces itself when ready and ends in-flight requests when told to stop."""

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM, sock: socket.socket, auth: ServerAuth,
                 starting: StartupResponder):
        super().__init__(config)
        self.llm, self.sock, self.auth, self.starting = llm, sock, auth, starting

    async def startup(self, sockets=None):
        # The responder stops accepting first; a connection that comes meanwhile waits in the backlog for uvicorn.
        self.starting.close()
        await super().startup(sockets)
        if self.started:
            print(banner(self.llm, self.sock.getsockname(), self.auth), flush=True)

    async def shutdown(self, sockets=None):
        # Before uvicorn waits for open responses: end them now, with an error they can still send.
        self.llm.close("the server is shutting down")
        await super().shutdown(sockets)


def banner(llm: AsyncLLM, sockname: tuple, auth: ServerAuth) -> str:
    """What `serve` prints once it listens; the only place a generated debug token is ever shown."""
    host, port = sockname[:2]
    url = _url(host, port)
    cfg = llm.engine.config
    lines = [f"devharness: serving {llm.model_name} at {url} (OpenAI API under {url}/v1; Ctrl-C stops)"]
    if not is_loopback(host) and auth.api_key is None:
        lines.append(f"devharness: warning: {host} is not loopback and /v1 has no authentication (add --api-key)")
    # Across machines (--ray-address, ranks on other nodes): which of the run's own ports others can reach.
    exposure = getattr(llm.engine.workers, "exposure", lambda: None)()
    if exposure:
        lines.append(exposure)
    token = ""
    if auth.debug_token_generated:   # --debug-token's own value is never echoed
        lines.append(f"  debug token (every /debug route needs 'Authorization: Bearer <token>'): {auth.debug_token}")
        token = " --token <debug token>"
    elif auth.debug_token is not None:
        token = " --token <your --debug-token>"
    if cfg.debug.enabled:
        for rank in range(cfg.parallel.world_size):
            lines.append(f"  rank {rank}: debugpy on {cfg.debug.host}:{cfg.debug.port_base + rank}")
    dashboard = getattr(llm.engine.workers, "dashboard_url", None)
    if dashboard:
        lines.append(f"  Ray dashboard: {dashboard if '://' in dashboard else 'http://' + dashboard}")
    tui = f"devharness tui --url {url}"
    lines.append(f"  live view: {tui}{token}" if cfg.debug.enabled else f"  live view: {tui}  (needs serve --debug)")
    return "\n".join(lines)
