"""What a client gets when something is wrong: OpenAI's error shape for every error (never FastAPI's
{"detail": ...}), always with a code, in text UTF-8 can carry; the OpenAPI schema documenting exactly
that (400, not FastAPI's 422); and the request-size limit."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from devharness.engine.async_llm import EngineDeadError
from devharness.server import api
from devharness.server.openai_schemas import FIELD_NAMES, ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)


_DEFAULT_CODES = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                  405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large", 500: "internal_error"}


def _printable(text) -> str | None:
    """Text that UTF-8 can carry: a lone surrogate (from a JSON \\ud800 escape) would make the error
    response itself fail to render, and the server drop the connection instead of answering."""
    return None if text is None else str(text).encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(status: int, message: str, code: str | None, param: str | None = None, type: str | None = None):
    type = type or ("invalid_request_error" if status < 500 else "server_error")
    code = code or _DEFAULT_CODES.get(status, "http_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": _printable(message), "type": type, "code": _printable(code),
                                   "param": _printable(param)}}, status)


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str
    param: str | None = None


class ErrorResponse(BaseModel):
    """Every error this server returns (OpenAI's shape)."""
    error: ErrorDetail


_ERROR_STATUSES = {400: "Invalid request: a bad or missing field (`param` names it) or malformed JSON",
                   401: "No or a wrong 'Authorization: Bearer' token",
                   404: "Unknown model, rank or bundle (or route)",
                   409: "A profile is running already (/start_profile), or none is (/stop_profile)",
                   408: "The request body did not arrive in time; the connection is closed",
                   413: "Request body too large",
                   429: "Too many unfinished choices (--max-pending-requests); see Retry-After",
                   500: "This request failed inside the engine; the engine goes on",
                   503: "The engine is unavailable: dead, or its workers restarting (then see Retry-After)"}


# Routes that name a rank (404 when the engine has none such) or read a worker from outside (503 when it cannot).
_MORE_ERRORS = {("post", "/debug/break"): [404], ("post", "/debug/release"): [404],
                ("get", "/debug/workers/{rank}/stack"): [503], ("get", "/debug/workers/{rank}/logs"): [503],
                ("post", "/start_profile"): [409, 503], ("post", "/stop_profile"): [409, 503]}


def document_errors(app: FastAPI, guarded: tuple[str, ...] = ()) -> None:
    """The OpenAPI schema with the errors the server really returns: a 400 in OpenAI's shape
    (ErrorResponse) where FastAPI would document its 422 {"detail": [...]}; a 401 under the
    `guarded` path prefixes (server/auth.py)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        # FastAPI passes bounds through floats (2**63 - 1 would read 2**63): take pydantic's exact ones.
        _, exact = models_json_schema([(m, "validation") for m in (CompletionRequest, ChatCompletionRequest)],
                                      ref_template="#/components/schemas/{model}")
        schemas.update({k: v for k, v in exact["$defs"].items() if k in schemas})
        model = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(model.pop("$defs", {}))
        schemas["ErrorResponse"] = model
        for path, ops in schema.get("paths", {}).items():
            for method, op in ops.items():
                if not isinstance(op, dict) or "responses" not in op:
                    continue
                op["responses"].pop("422", None)
                statuses = [400]
                if method == "post":
                    statuses += [408, 413]
                if any(path == prefix or path.startswith(prefix + "/") for prefix in guarded):
                    statuses.append(401)
                if method == "post" and path.startswith("/v1/"):
                    statuses += [404, 429, 500, 503]
                    # "stream": true answers with server-sent events
                    ok = op["responses"].get("200", {}).setdefault("content", {})
                    ok.setdefault("text/event-stream", {"schema": {"type": "string"}})
                elif path == "/health" or "{" in path:
                    statuses += [404] if "{" in path else [503]
                statuses += _MORE_ERRORS.get((method, path), [])
                for status in sorted(statuses):
                    op["responses"].setdefault(str(status), {
                        "description": _ERROR_STATUSES[status],
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})
        return schema

    app.openapi = openapi


def _validation_error(errors: list[dict]) -> tuple[str, str, str | None]:
    """Pydantic's errors as (one line, OpenAI-style code, param). A union adds an error per branch,
    so messages are grouped by field; a branch that failed only on its type is dropped when another
    branch of the same field got past the type (prompt [2**70] is out of range, not "not a string")."""
    errors = _drop_union_type_misses(errors)
    by_field: dict[str, list[str]] = {}
    for e in errors:
        kind, loc = e.get("type", ""), [str(p) for p in e.get("loc", ())]
        if loc and loc[0] in _PARAM_SOURCES:   # ("query", "lines"), ("path", "rank"): the name is the field
            loc = loc[1:2]
        elif loc and loc[0] == "body":
            loc = loc[1:]
        if kind == "json_invalid":
            return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", \
                "invalid_json", None
        if not loc:
            return "the request body must be a JSON object", "invalid_type", None
        if kind == "extra_forbidden":
            field, msg = ".".join(loc), "unrecognized request argument"
        else:   # union branches add loc parts like "str" or "list[int]": keep field names and indices
            # (the first part always names a field: the /debug bodies' fields are not the OpenAI ones)
            field = ".".join(p for i, p in enumerate(loc) if i == 0 or p in FIELD_NAMES or p.isdigit())
            msg = e.get("msg", "invalid")
        by_field.setdefault(field, [])
        if msg not in by_field[field]:
            by_field[field].append(msg)
    kind = errors[0].get("type", "")
    code = "missing_required_parameter" if kind == "missing" else "unknown_parameter" \
        if kind == "extra_forbidden" else "invalid_value" if kind.startswith(_VALUE_ERRORS) \
        else "invalid_type"
    parts = [f"{f}: {' or '.join(m)}" for f, m in by_field.items()]
    return "invalid request: " + "; ".join(parts[:5]), code, next(iter(by_field), None)


# Where FastAPI found a parameter other than the body: the loc's next part is its name.
_PARAM_SOURCES = ("query", "path", "header", "cookie")

# Pydantic error types for a value of the right type that is out of bounds: NaN / Infinity
# (finite_number), a lone surrogate (invalid_unicode, protocol.Text), a logit_bias key that is no token id.
_VALUE_ERRORS = ("greater", "less", "too_", "finite_number", "invalid_unicode", "string_pattern_mismatch")


def _drop_union_type_misses(errors: list[dict]) -> list[dict]:
    def head(e):   # the loc up to the union branch's tag (e.g. "list[constrained-int]")
        loc = [p for p in e.get("loc", ()) if p != "body"]
        for i, p in enumerate(loc):
            if not (isinstance(p, int) or str(p) in FIELD_NAMES or str(p).isdigit()):
                return tuple(loc[:i]), True
        return tuple(loc), False

    def type_miss(e):
        return e.get("type", "").endswith("_type")

    heads = [head(e) for e in errors]
    got_further = {h for (h, branch), e in zip(heads, errors) if branch and not type_miss(e)}
    kept = [e for (h, branch), e in zip(heads, errors) if not (branch and type_miss(e) and h in got_further)]
    return kept or errors


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(api.APIError)
    async def on_api_error(request: Request, e: api.APIError):
        resp = error_response(e.status, e.message, e.code, e.param, e.type)
        resp.headers.update(e.headers)
        return resp

    @app.exception_handler(EngineDeadError)   # e.g. a pause asked of a dead or restarting engine
    async def on_engine_unavailable(request: Request, e: EngineDeadError):
        return await on_api_error(request, api._unavailable(e))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError):
        return error_response(400, *_validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        resp = error_response(e.status_code, str(e.detail), None)   # _DEFAULT_CODES names the status
        resp.headers.update(e.headers or {})   # e.g. 405's Allow
        return resp

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "internal_error")


class BodySizeLimit:
    """Refuse bodies over `max_bytes` with 413, by Content-Length or while a chunked body streams in."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            resp = error_response(413, f"the request body is larger than {self.max_bytes} bytes", "request_too_large")
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
