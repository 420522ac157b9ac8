"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (both streaming as server-sent
events like OpenAI's) and /v1/models; the request models they validate against are in protocol.py.

Every check runs before the response starts, so a bad request is a 4xx and never reaches the
engine.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from devharness.engine.async_llm import AsyncLLM, EngineDeadError, EngineRestartingError, RequestFailedError
from devharness.engine.output import RequestOutput
from devharness.engine.request_stream import RequestStream
from devharness.sampling_params import SamplingParams
from devharness.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

router = APIRouter()
DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions


class APIError(Exception):
    """An error for the client, rendered as {"error": {"message", "type", "code", "param"}}."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}   # e.g. a 429's Retry-After


# -- routes --------------------------------------------------------------------------------------

@router.get("/v1/models")
async def list_models(request: Request):
    llm: AsyncLLM = request.app.state.llm
    return {"object": "list", "data": [{"id": llm.model_name, "object": "model", "created": 0,
                                        "owned_by": "devharness", "max_model_len": llm.max_model_len}]}


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request):
    llm: AsyncLLM = request.app.state.llm
    _check_capacity(request)
    _check_common(llm, body)
    if body.echo or body.suffix is not None or body.best_of not in (None, 1):
        raise APIError(400, "echo, suffix and best_of are not supported", "unsupported_parameter")
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    params = _sampling_params(body, max_tokens, body.logprobs)
    text, ids = _prepare(llm, body.prompt, max_tokens, check_max_tokens=True, prompt_param="prompt")
    fmt = _Formatter(llm, f"cmpl-{_base_request_id(request)}", chat=False, body=body)
    return await _respond(request, llm, fmt, body, params, text, ids)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    llm: AsyncLLM = request.app.state.llm
    _check_capacity(request)
    _check_common(llm, body)
    if llm.tokenizer is None:
        raise APIError(400, f"model {llm.model_name} has no tokenizer, so no chat template; "
                            "use /v1/completions with token ids", "unsupported_model")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "invalid_value", "top_logprobs")
    messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                 else "".join(p.text for p in m.content or ())} for m in body.messages]
    try:
        rendered = llm.tokenizer.apply_chat_template(messages)
    except Exception as e:   # a template's raise_exception() or a Jinja error: the messages don't fit it
        raise APIError(400, f"the chat template rejected these messages: {e}", "invalid_messages", "messages")
    try:
        ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    except Exception as e:   # protocol.Text keeps out what we know breaks it; anything else is still the input's
        raise APIError(400, f"the tokenizer rejected these messages: {type(e).__name__}: {e}", "invalid_messages",
                       "messages") from None
    explicit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    # Like OpenAI, no limit given means "up to the context length".
    max_tokens = explicit if explicit is not None else max(llm.max_model_len - len(ids), 1)
    params = _sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    text, ids = _prepare(llm, {"prompt_token_ids": ids, "prompt": rendered}, max_tokens,
                         check_max_tokens=explicit is not None, prompt_param="messages")
    fmt = _Formatter(llm, f"chatcmpl-{_base_request_id(request)}", chat=True, body=body)
    return await _respond(request, llm, fmt, body, params, text, ids)


# -- checks ---------------------------------------------------------------------------------------

MAX_REQUEST_ID_CHARS = 128
RETRY_AFTER_S = 1   # a step or two frees a slot; clients back off further on their own


def _base_request_id(request: Request) -> str:
    """The client's X-Request-Id (to find its request in logs, worker state and breakpoints), else a fresh one."""
    given = request.headers.get("x-request-id")
    if given is None:
        return uuid.uuid4().hex
    if not 0 < len(given) <= MAX_REQUEST_ID_CHARS or not all(33 <= ord(c) < 127 for c in given):
        raise APIError(400, f"the X-Request-Id header must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII "
                            "characters without spaces", "invalid_request_id", "X-Request-Id")
    return given


def _check_capacity(request: Request) -> None:
    """Past --max-pending-requests a new request is refused before any work; those already in go on."""
    limit = request.app.state.max_pending_requests
    if request.app.state.llm.num_requests >= limit:
        raise APIError(429, f"the server holds {limit} unfinished requests, its --max-pending-requests; "
                            f"retry in {RETRY_AFTER_S} s", "too_many_pending_requests", type="rate_limit_error",
                       headers={"Retry-After": str(RETRY_AFTER_S)})


def _unavailable(e: EngineDeadError) -> APIError:
    """503: the engine is dead for good, or its workers are restarting (then Retry-After says when to come back)."""
    if isinstance(e, EngineRestartingError):
        return APIError(503, f"{e}; retry in {e.retry_after_s} s", "engine_restarting",
                        headers={"Retry-After": str(e.retry_after_s)})
    return APIError(503, str(e), "engine_unavailable")


def _check_common(llm: AsyncLLM, body: SamplingRequest) -> None:
    if body.model is not None and body.model != llm.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {llm.model_name!r}",
                       "model_not_found", "model")
    if body.n != 1:
        raise APIError(400, f"n={body.n}: this server returns one choice per request; send n=1",
                       "invalid_value", "n")
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        if getattr(body, name) != neutral:
            raise APIError(400, f"{name} is not supported; leave it at 0", "unsupported_parameter", name)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", "unsupported_parameter", "logit_bias")


def _sampling_params(body: SamplingRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=body.top_k, seed=body.seed, stop=stop, stop_token_ids=body.stop_token_ids or [],
                              ignore_eos=body.ignore_eos, logprobs=logprobs)
    except ValueError as e:   # the request model checks ranges already; this catches the rest (e.g. stop: [""])
        raise APIError(400, str(e), "invalid_value") from None


def _prepare(llm: AsyncLLM, prompt, max_tokens: int, check_max_tokens: bool,
             prompt_param: str) -> tuple[str | None, list[int]]:
    """(text, token ids), with OpenAI's context-length error when prompt + max_tokens cannot fit."""
    if isinstance(prompt, str) and prompt and llm.tokenizer is not None:
        try:
            prompt = {"prompt_token_ids": llm.tokenizer.encode(prompt), "prompt": prompt}
        except Exception as e:   # protocol.Text keeps out what we know breaks it; anything else is still the input's
            raise APIError(400, f"the tokenizer rejected this prompt: {type(e).__name__}: {e}", "invalid_prompt",
                           prompt_param) from None
    # A string left here is empty or has no tokenizer: process_prompt rejects it below.
    num_prompt = 0 if isinstance(prompt, str) else \
        len(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)
    limit = llm.max_model_len
    if num_prompt >= limit or (check_max_tokens and num_prompt + max_tokens > limit):
        raise APIError(400, f"this model's maximum context length is {limit} tokens, but the request has "
                            f"{num_prompt} prompt tokens and asks for {max_tokens} more; shorten the prompt "
                            "or lower max_tokens", "context_length_exceeded",
                       prompt_param if num_prompt >= limit else "max_tokens")
    try:
        return llm.process_prompt(prompt)
    except ValueError as e:
        raise APIError(400, str(e), "invalid_prompt", prompt_param) from None


# -- running a request ------------------------------------------------------------------------------

async def _respond(request: Request, llm: AsyncLLM, fmt: "_Formatter", body: SamplingRequest,
                   params: SamplingParams, text: str | None, ids: list[int]):
    try:
        stream = llm.add_request(None, params, fmt.request_id, processed=(text, ids))
    except ValueError as e:
        raise APIError(400, str(e), "invalid_request") from None
    except EngineDeadError as e:
        raise _unavailable(e) from None
    run = _Run(request.app.state.metrics, stream)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_sse(run, fmt, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(run.close, "abort"))
    consumer = asyncio.ensure_future(run.collect())
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        consumer.cancel()   # a no-op once done; else the client left: stop generating for nobody
        run.close("abort")
    if consumer not in done:
        raise APIError(499, "the client closed the connection", "client_closed_request")
    try:
        final = consumer.result()
    except EngineDeadError as e:
        raise _unavailable(e) from None
    except RequestFailedError as e:   # this request alone; the engine serves the others
        raise APIError(500, str(e), "request_failed") from None
    return fmt.response(final)


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Run:
    """One request's outputs plus the metrics recorded when it ends, however it ends."""

    def __init__(self, metrics, stream: RequestStream):
        self.metrics = metrics
        self.stream = stream
        self.start = time.monotonic()
        self.first_token_s: float | None = None
        self.last: RequestOutput | None = None
        self.closed = False

    async def outputs(self):
        try:
            async for out in self.stream:
                if self.first_token_s is None and out.new_token_ids:
                    self.first_token_s = time.monotonic() - self.start
                self.last = out
                yield out
        except (EngineDeadError, RequestFailedError):
            self.close("error")
            raise
        self.close(self.last.outputs[0].finish_reason if self.last else "abort")

    async def collect(self) -> RequestOutput:
        async for _ in self.outputs():
            pass
        return self.last

    def close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        n_out = len(self.last.outputs[0].token_ids) if self.last else 0
        self.metrics.record_request(reason or "abort", len(self.stream.prompt_token_ids), n_out,
                                    self.first_token_s, time.monotonic() - self.start)
        self.stream.abort()


async def _sse(run: _Run, fmt: "_Formatter", include_usage: bool):
    try:
        if fmt.chat:
            yield _event(fmt.chunk(delta={"role": "assistant", "content": ""}, logprobs=None, finish_reason=None))
        async for out in run.outputs():
            chunk = fmt.stream_chunk(out)
            if chunk is not None:
                yield _event(chunk)
        if include_usage and run.last is not None:
            yield _event(fmt.chunk(usage=fmt.usage(run.last)))
    except (EngineDeadError, RequestFailedError) as e:
        # Headers are sent already, so the error travels as an event; the openai client raises it.
        code = "request_failed" if isinstance(e, RequestFailedError) else "engine_unavailable"
        yield _event({"error": {"message": str(e), "type": "server_error", "code": code, "param": None}})
    finally:
        run.close("abort")
    yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Formatter:
    """OpenAI's response and chunk shapes, for completions (text) or chat (message / delta)."""

    def __init__(self, llm: AsyncLLM, request_id: str, chat: bool, body: SamplingRequest):
        self.llm, self.request_id, self.chat, self.body = llm, request_id, chat, body
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.text_offset = 0

    def chunk(self, delta: dict | None = None, usage: dict | None = None, **choice) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        choices = [] if usage is not None else [{"index": 0, **({"delta": delta} if self.chat else {}), **choice}]
        out = {"id": self.request_id, "object": obj, "created": self.created, "model": self.llm.model_name,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def stream_chunk(self, out: RequestOutput) -> dict | None:
        c = out.outputs[0]
        n_total, new_ids = len(c.token_ids), list(out.new_token_ids)
        finish = c.finish_reason if out.finished else None
        if not out.new_text and finish is None and not self.body.return_token_ids and c.logprobs is None:
            return None
        choice = {"logprobs": self._logprobs(c.logprobs, c.token_ids, n_total - len(new_ids)),
                  "finish_reason": finish}
        if self.body.return_token_ids:
            choice["token_ids"] = new_ids
        if self.chat:
            return self.chunk(delta={"content": out.new_text} if out.new_text or finish is None else {}, **choice)
        return self.chunk(text=out.new_text, **choice)

    def response(self, out: RequestOutput) -> dict:
        c = out.outputs[0]
        choice = {"index": 0, "logprobs": self._logprobs(c.logprobs, c.token_ids, 0),
                  "finish_reason": c.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        if self.body.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
            choice["prompt_token_ids"] = list(out.prompt_token_ids)
        return {"id": self.request_id, "object": self.object, "created": self.created,
                "model": self.llm.model_name, "choices": [choice], "usage": self.usage(out)}

    @staticmethod
    def usage(out: RequestOutput) -> dict:
        p, g = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

    def _token_str(self, token_id: int) -> str:
        tok = self.llm.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else f"token_id:{token_id}"

    def _logprobs(self, lps, token_ids, start: int) -> dict | None:
        """OpenAI's logprobs of the tokens from index `start` on (a stream chunk sends only its new ones)."""
        if lps is None:
            return None
        lps, ids = lps[start:], token_ids[start:]
        if self.chat:
            def entry(tid, lp):
                s = self._token_str(tid)
                return {"token": s, "logprob": lp, "bytes": list(s.encode())}
            return {"content": [{**entry(t, l.token_logprob),
                                 "top_logprobs": [entry(i, v) for i, v in zip(l.top_token_ids, l.top_logprobs)]}
                                for t, l in zip(ids, lps)]}
        tokens = [self._token_str(t) for t in ids]
        offsets = []
        for s in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": [l.token_logprob for l in lps],
                "top_logprobs": [{self._token_str(i): v for i, v in zip(l.top_token_ids, l.top_logprobs)}
                                 for l in lps], "text_offset": offsets}
