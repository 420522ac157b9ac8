"""The server app (`build_app`) and `devharness serve` (`serve_main`): uvicorn in the main thread,
the engine loop in its own (AsyncLLM). Errors always leave in OpenAI's shape, never FastAPI's
{"detail": ...}; a bad request is a 4xx and the server keeps serving the others."""
from __future__ import annotations

import ipaddress
import logging
import signal
import socket
import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from devharness.engine.async_llm import AsyncLLM, EngineDeadError
from devharness.server import api
from devharness.server.metrics import ServerMetrics
from devharness.server.protocol import FIELD_NAMES

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024 * 1024
# Long enough for in-flight responses to send their error event, short enough that Ctrl-C is prompt.
GRACEFUL_SHUTDOWN_S = 10


def build_app(llm: AsyncLLM, debug_hub=None) -> FastAPI:
    """The OpenAI routes, /health and /metrics over `llm`; with a debug hub, the /debug routes too."""
    app = FastAPI(title="devharness", summary="OpenAI-compatible server of a debuggable inference engine")
    app.state.llm = llm
    app.state.metrics = ServerMetrics(llm)
    app.state.debug_hub = debug_hub
    app.add_middleware(BodySizeLimit, max_bytes=MAX_BODY_BYTES)
    _install_error_handlers(app)
    app.include_router(api.router)

    @app.get("/health")
    async def health():
        try:
            await llm.check_health()
        except EngineDeadError as e:
            return _error(503, str(e), "engine_unavailable")
        return {"status": "ok", "state": llm.stats()["state"]}

    @app.get("/metrics")
    async def metrics():
        m: ServerMetrics = app.state.metrics
        return Response(m.render(), media_type=m.content_type)

    if debug_hub is not None:
        from devharness.server.debug_api import router as debug_router
        app.include_router(debug_router)
    return app


# -- errors ---------------------------------------------------------------------------------------

def _error(status: int, message: str, code: str | None, param: str | None = None, type: str | None = None):
    type = type or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": type, "code": code, "param": param}}, status)


def _validation_error(errors: list[dict]) -> tuple[str, str, str | None]:
    """Pydantic's errors as (one line, OpenAI-style code, param). A union adds an error per branch,
    so messages are grouped by field."""
    by_field: dict[str, list[str]] = {}
    for e in errors:
        kind, loc = e.get("type", ""), [str(p) for p in e.get("loc", ()) if p != "body"]
        if kind == "json_invalid":
            return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", \
                "invalid_json", None
        if not loc:
            return "the request body must be a JSON object", "invalid_type", None
        if kind == "extra_forbidden":
            field, msg = ".".join(loc), "unrecognized request argument"
        else:   # union branches add loc parts like "str" or "list[int]": keep field names and indices
            field = ".".join(p for p in loc if p in FIELD_NAMES or p.isdigit())
            msg = e.get("msg", "invalid")
        by_field.setdefault(field, [])
        if msg not in by_field[field]:
            by_field[field].append(msg)
    kind = errors[0].get("type", "")
    code = "missing_required_parameter" if kind == "missing" else "unknown_parameter" \
        if kind == "extra_forbidden" else "invalid_value" if kind.startswith(("greater", "less", "too_")) \
        else "invalid_type"
    parts = [f"{f}: {' or '.join(m)}" for f, m in by_field.items()]
    return "invalid request: " + "; ".join(parts[:5]), code, next(iter(by_field), None)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(api.APIError)
    async def on_api_error(request: Request, e: api.APIError):
        return _error(e.status, e.message, e.code, e.param, e.type)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError):
        return _error(400, *_validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status_code)
        return _error(e.status_code, str(e.detail), code)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error(500, f"internal error: {type(e).__name__}: {e}", "internal_error")


class BodySizeLimit:
    """Refuse bodies over `max_bytes` with 413, by Content-Length or while a chunked body streams in."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            resp = _error(413, f"the request body is larger than {self.max_bytes} bytes", "request_too_large")
            return await resp(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                # FastAPI re-raises HTTPException from body reading; our handler gives it OpenAI's shape.
                raise StarletteHTTPException(413, f"the request body is larger than {self.max_bytes} bytes")
            return message

        return await self.app(scope, limited_receive, send)


# -- `devharness serve` ---------------------------------------------------------------------------------

def serve_main(args) -> int:
    from devharness.cli import llm_kwargs

    _bind(args.host, args.port).close()   # a busy port fails now, not after loading the model
    llm = AsyncLLM.from_llm_kwargs(**llm_kwargs(args))
    try:
        # Bound only now, so worker processes started while loading never inherit the listener.
        sock = _bind(args.host, args.port)
        hub = None
        if llm.engine.config.debug.enabled:
            from devharness.debug.hub import DebugHub
            hub = DebugHub(llm.engine)
        config = uvicorn.Config(build_app(llm, hub), log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers in
        # place that is a no-op, so the engine's workers are shut down below instead of the process
        # dying (SIGTERM's default) or unwinding with a KeyboardInterrupt traceback.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        with sock:
            _Server(config, llm, sock).run(sockets=[sock])
    finally:
        llm.shutdown()
    print("devharness: server stopped", flush=True)
    return 0


def _bind(host: str, port: int) -> socket.socket:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: must be a TCP port in 0..65535 (0 picks a free one)")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port or --host") from None
    return sock


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Server(uvicorn.Server):
    """uvicorn.Server that announces itself when ready and ends in-flight requests when told to stop."""

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM, sock: socket.socket):
        super().__init__(config)
        self.llm, self.sock = llm, sock

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            _announce(self.llm, self.sock)

    async def shutdown(self, sockets=None):
        # Before uvicorn waits for open responses: end them now, with an error they can still send.
        self.llm.close("the server is shutting down")
        await super().shutdown(sockets)


def _announce(llm: AsyncLLM, sock: socket.socket) -> None:
    host, port = sock.getsockname()[:2]
    url = _url(host, port)
    cfg = llm.engine.config
    lines = [f"devharness: serving {llm.model_name} at {url} (OpenAI API under {url}/v1; Ctrl-C stops)"]
    if not _is_loopback(host):
        lines.append(f"devharness: warning: {host} is not loopback and the API has no authentication")
    if cfg.debug.enabled:
        for rank in range(cfg.parallel.world_size):
            lines.append(f"  rank {rank}: debugpy on {cfg.debug.host}:{cfg.debug.port_base + rank}")
    dashboard = getattr(llm.engine.core.executor, "dashboard_url", None)
    if dashboard:
        lines.append(f"  Ray dashboard: {dashboard if '://' in dashboard else 'http://' + dashboard}")
    tui = f"devharness tui --url {url}"
    lines.append(f"  live view: {tui}" if cfg.debug.enabled else f"  live view: {tui}  (needs serve --debug)")
    print("\n".join(lines), file=sys.stdout, flush=True)
