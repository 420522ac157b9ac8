"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (both streaming as server-sent
events like OpenAI's) and /v1/models; the request models they validate against are in protocol.py.

Every check runs before the response starts, so a bad request is a 4xx and never reaches the
engine.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass

import msgspec

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from devharness.engine.async_llm import AsyncLLM, EngineDeadError, EngineRestartingError, RequestFailedError
from devharness.engine.output import RequestOutput
from devharness.protocol.errors import NON_FINITE
from devharness.engine.request_stream import RequestStream
from devharness.sampling_params import INT64_MIN, SamplingParams, SamplingParamsError
from devharness.config import MAX_CHOICES, MAX_LOGPROB_ENTRIES
from devharness.server.openai_schemas import ChatCompletionRequest, CompletionRequest, SamplingRequest

logger = logging.getLogger(__name__)
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
    headers = _ignored_fields_header(body, request)
    prompts = _prompt_batch(body.prompt)
    _check_capacity(request, body.n * len(prompts), "n" if len(prompts) == 1 else "prompt")
    _check_common(llm, body, len(prompts), "prompt")
    if body.suffix is not None or body.best_of not in (None, 1):
        raise APIError(400, "suffix and best_of are not supported", "unsupported_parameter")
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    if max_tokens == 0 and not body.echo and body.prompt_logprobs is None:
        raise APIError(400, "max_tokens: 0 generates nothing; it is allowed only with echo or prompt_logprobs "
                            "(to score the prompt)", "invalid_value", "max_tokens")
    if body.echo and llm.tokenizer is None:
        raise APIError(400, f"echo needs a tokenizer to give the prompt's text, and model {llm.model_name} has none",
                       "unsupported_model", "echo")
    # echo with logprobs gives the prompt's tokens their logprobs too, as OpenAI and vLLM do.
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    # max_tokens 0 runs the prompt and leaves out the one token that prefill samples.
    params = _sampling_params(body, max(max_tokens, 1), body.logprobs, prompt_logprobs)
    inputs = await asyncio.to_thread(
        lambda: [_prepare(llm, p, max(max_tokens, 1), check_max_tokens=True, prompt_param="prompt") for p in prompts])
    # The reply's logprobs: each prompt token's top ones, once for prompt_logprobs and once more for echo.
    prompt_renders = (body.prompt_logprobs is not None) + (body.echo and body.logprobs is not None)
    _check_logprob_entries(body.n, [len(ids) for _, ids in inputs], prompt_logprobs, prompt_renders, max_tokens,
                           body.logprobs, "prompt_logprobs" if body.prompt_logprobs is not None else "logprobs",
                           "logprobs")
    fmt = _Formatter(llm, f"cmpl-{_base_request_id(request)}", chat=False, body=body, drop_output=max_tokens == 0)
    return await _respond(request, llm, fmt, body, params, inputs, headers)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    llm: AsyncLLM = request.app.state.llm
    headers = _ignored_fields_header(body, request)
    _check_capacity(request, body.n, "n")
    _check_common(llm, body, 1, "n")
    if llm.tokenizer is None:
        raise APIError(400, f"model {llm.model_name} has no tokenizer, so no chat template; "
                            "use /v1/completions with token ids", "unsupported_model")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "invalid_value", "top_logprobs")
    # As vLLM: chat_template_kwargs may set add_generation_prompt too; the messages are the request's own.
    variables = {"add_generation_prompt": body.add_generation_prompt, **(body.chat_template_kwargs or {})}
    if "messages" in variables:
        raise APIError(400, "chat_template_kwargs cannot set 'messages': send them in messages", "invalid_value",
                       "chat_template_kwargs")
    messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                 else "".join(p.text for p in m.content or ())} for m in body.messages]
    rendered, ids = await asyncio.to_thread(_render_chat, llm, messages, variables)
    explicit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    # Like OpenAI, no limit given means "up to the context length".
    max_tokens = explicit if explicit is not None else max(llm.max_model_len - len(ids), 1)
    params = _sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                              body.prompt_logprobs)
    inputs = [_prepare(llm, {"prompt_token_ids": ids, "prompt": rendered}, max_tokens,
                       check_max_tokens=explicit is not None, prompt_param="messages")]
    _check_logprob_entries(body.n, [len(ids)], body.prompt_logprobs, body.prompt_logprobs is not None, max_tokens,
                           (body.top_logprobs or 0) if body.logprobs else None, "prompt_logprobs",
                           "top_logprobs" if body.top_logprobs else "logprobs")
    fmt = _Formatter(llm, f"chatcmpl-{_base_request_id(request)}", chat=True, body=body)
    return await _respond(request, llm, fmt, body, params, inputs, headers)


def _render_chat(llm: AsyncLLM, messages: list[dict], variables: dict) -> tuple[str, list[int]]:
    """The chat's prompt text and token ids (off the event loop: a long chat takes a while to render and tokenize)."""
    try:
        rendered = llm.tokenizer.apply_chat_template(messages, **variables)
    except Exception as e:   # a template's raise_exception() or a Jinja error: the messages don't fit it
        raise APIError(400, f"the chat template rejected these messages: {e}", "invalid_messages", "messages")
    try:
        return rendered, llm.tokenizer.encode(rendered, add_special_tokens=False)
    except Exception as e:   # protocol.Text keeps out what we know breaks it; anything else is still the input's
        raise APIError(400, f"the tokenizer rejected these messages: {type(e).__name__}: {e}", "invalid_messages",
                       "messages") from None


def _prompt_batch(prompt) -> list:
    """The request's prompts: one text or token-id list, or a batch of either."""
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):   # an empty list is one empty prompt
        return [prompt]
    return list(prompt)


MAX_IGNORED_HEADER_CHARS = 1024


def _ignored_fields_header(body: SamplingRequest, request: Request) -> dict[str, str]:
    """vLLM's way with a field it does not know: ignore it with a warning in the log, so that a benchmark's
    requests are not all refused over one field. The X-Ignored-Fields header names them to the client."""
    names = body.unknown_fields()
    if not names:
        return {}
    # A header value is printable ASCII: a name of other characters (or none) travels as a JSON string, and a
    # long list is cut.
    text = ", ".join(n if _PLAIN_NAME.fullmatch(n) else json.dumps(n) for n in names)
    if len(text) > MAX_IGNORED_HEADER_CHARS:
        text = text[:MAX_IGNORED_HEADER_CHARS] + f"... ({len(names)} fields)"
    logger.warning("%s %s: ignored unknown fields: %s", request.method, request.url.path, text)
    return {IGNORED_FIELDS_HEADER: text}


IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


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


def _check_capacity(request: Request, choices: int, param: str) -> None:
    """--max-pending-requests bounds the unfinished choices (engine requests: n per prompt), so that one request
    of many choices counts as many. A request that does not fit now is refused before any work (429; those
    already in go on); one that could never fit is a 400, as retrying it would not help."""
    limit = request.app.state.max_pending_requests
    if choices > limit:
        raise APIError(400, f"this request asks for {choices} choices (n times its prompts), more than the server's "
                            f"--max-pending-requests {limit} unfinished choices in all", "invalid_value", param)
    held = request.app.state.llm.num_requests
    if held + choices > limit:
        raise APIError(429, f"the server holds {held} unfinished choices and this request's {choices} would pass "
                            f"its --max-pending-requests {limit}; retry in {RETRY_AFTER_S} s",
                       "too_many_pending_requests", type="rate_limit_error",
                       headers={"Retry-After": str(RETRY_AFTER_S)})


def _unavailable(e: EngineDeadError) -> APIError:
    """503: the engine is dead for good, or its workers are restarting (then Retry-After says when to come back)."""
    if isinstance(e, EngineRestartingError):
        return APIError(503, f"{e}; retry in {e.retry_after_s} s", "engine_restarting",
                        headers={"Retry-After": str(e.retry_after_s)})
    return APIError(503, str(e), "engine_unavailable")


def _check_common(llm: AsyncLLM, body: SamplingRequest, num_prompts: int, prompt_param: str) -> None:
    if body.model is not None and body.model != llm.model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {llm.model_name!r}",
                       "model_not_found", "model")
    if body.n * num_prompts > MAX_CHOICES:
        raise APIError(400, f"n={body.n} times {num_prompts} prompts asks for {body.n * num_prompts} choices; this "
                            f"server gives at most {MAX_CHOICES} per request", "invalid_value",
                       "n" if num_prompts == 1 else prompt_param)
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        if getattr(body, name) != neutral:
            raise APIError(400, f"{name} is not supported; leave it at 0", "unsupported_parameter", name)
    vocab = llm.engine.source.arch.vocab_size
    if body.logit_bias and any(int(t) >= vocab for t in body.logit_bias):
        raise APIError(400, f"logit_bias: token ids {sorted(int(t) for t in body.logit_bias if int(t) >= vocab)[:4]} "
                            f"are outside the vocabulary [0, {vocab})", "invalid_value", "logit_bias")


def _check_logprob_entries(n: int, prompt_lens: list[int], prompt_k: int | None, prompt_renders: int,
                           max_tokens: int, k: int | None, prompt_param: str, param: str) -> None:
    """A reply carries at most MAX_LOGPROB_ENTRIES logprobs (each token scored, and each of its top k): past that the
    reply, and the server's memory while it builds it, would grow with what the client asks, unbounded."""
    in_prompts = n * sum(prompt_lens) * (prompt_k + 1) * prompt_renders if prompt_k is not None else 0
    in_outputs = n * len(prompt_lens) * max_tokens * (k + 1) if k is not None else 0
    if in_prompts + in_outputs > MAX_LOGPROB_ENTRIES:
        raise APIError(400, f"this request asks for {in_prompts + in_outputs} logprobs ({in_prompts} over its prompts' "
                            f"tokens, {in_outputs} over up to {max_tokens} tokens each of its {n * len(prompt_lens)} "
                            f"choices, each token's top ones and its own); a reply carries at most "
                            f"{MAX_LOGPROB_ENTRIES} (MAX_LOGPROB_ENTRIES): ask for fewer choices, tokens or top "
                            "logprobs", "invalid_value", prompt_param if in_prompts >= in_outputs else param)


def _sampling_params(body: SamplingRequest, max_tokens: int, logprobs: int | None,
                     prompt_logprobs: int | None) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=body.top_k, seed=body.seed, stop=stop, stop_token_ids=body.stop_token_ids or [],
                              ignore_eos=body.ignore_eos, logprobs=logprobs, min_tokens=body.min_tokens,
                              repetition_penalty=body.repetition_penalty,
                              logit_bias={int(t): b for t, b in (body.logit_bias or {}).items()},
                              include_stop_str_in_output=body.include_stop_str_in_output,
                              skip_special_tokens=body.skip_special_tokens,
                              spaces_between_special_tokens=body.spaces_between_special_tokens,
                              prompt_logprobs=prompt_logprobs)
    except SamplingParamsError as e:   # the request model checks ranges already; this catches the rest (stop's total)
        raise APIError(400, str(e), "invalid_value", e.field) from None


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

def _child_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed of a request with n > 1 and a seed (vLLM's seed + index), kept in 64 bits."""
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


@dataclass
class _Choice:
    """One engine request of an API request: a prompt's `n`th sample, `index` in OpenAI's numbering."""

    index: int
    text: str | None       # the prompt's text, where it came as text
    ids: list[int]
    run: "_Run"
    text_offset: int = 0   # completions' logprobs.text_offset of the next token
    started: bool = False  # a stream chunk has carried it (the echo and the prompt logprobs go in the first)
    final: RequestOutput | None = None


async def _respond(request: Request, llm: AsyncLLM, fmt: "_Formatter", body: SamplingRequest,
                   params: SamplingParams, inputs: list[tuple[str | None, list[int]]], headers: dict[str, str]):
    n, choices = body.n, []
    # Again with nothing awaited before the adds: requests that passed the first check together may not all fit.
    _check_capacity(request, n * len(inputs), "n")
    try:
        for i, (text, ids) in enumerate(inputs):
            for j in range(n):
                index = i * n + j
                # Each choice draws its own stream: a seed gives choice j seed + j, no seed a fresh one each.
                p = params if j == 0 or params.seed is None else \
                    msgspec.structs.replace(params, seed=_child_seed(params.seed, j))
                rid = fmt.request_id if len(inputs) * n == 1 else f"{fmt.request_id}-{index}"
                stream = llm.add_request(None, p, rid, processed=(text, ids))
                choices.append(_Choice(index, text, ids, _Run(request.app.state.metrics, stream)))
    except (ValueError, EngineDeadError) as e:
        for c in choices:
            c.run.close("abort")
        if isinstance(e, EngineDeadError):
            raise _unavailable(e) from None
        raise APIError(400, str(e), "invalid_request") from None
    if body.stream:
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options.continuous_usage_stats   # vLLM: only with include_usage
        return StreamingResponse(_sse(choices, fmt, include_usage, continuous), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **headers},
                                 background=BackgroundTask(_close_all, choices))
    consumers = [asyncio.ensure_future(c.run.collect()) for c in choices]
    everything = asyncio.gather(*consumers)
    everything.add_done_callback(_retrieve)   # after a disconnect it ends cancelled, awaited by no one
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        done, _ = await asyncio.wait({everything, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        for consumer in consumers:
            consumer.cancel()   # a no-op once done; else the client left or a choice failed: stop the others
        _close_all(choices)
    if everything not in done:
        everything.cancel()
        logger.info("%s: the client closed the connection; its %d choice(s) aborted", fmt.request_id, len(choices))
        raise APIError(499, "the client closed the connection", "client_closed_request")
    try:
        finals = everything.result()
    except EngineDeadError as e:
        raise _unavailable(e) from None
    except RequestFailedError as e:   # this request alone; the engine serves the others
        raise APIError(500, str(e), _failed_code(e)) from None
    for c, final in zip(choices, finals):
        c.final = final
    return JSONResponse(fmt.response(choices), headers=headers)


def _failed_code(e: RequestFailedError) -> str:
    """A failed request's error code: "non_finite" where the numerics check ended it, else "request_failed"."""
    return NON_FINITE if e.kind == NON_FINITE else "request_failed"


def _close_all(choices: list[_Choice]) -> None:
    for c in choices:
        c.run.close("abort")


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()   # else asyncio logs it "never retrieved", traceback and all


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
        if self.last is not None:
            self.metrics.record_queue_time(self.last.queued_s)
        self.stream.abort()


async def _sse(choices: list[_Choice], fmt: "_Formatter", include_usage: bool, continuous: bool):
    """The choices' chunks as their tokens come, each naming its choice's index; then usage, then [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: _Choice):
        try:
            async for out in c.run.outputs():
                queue.put_nowait((c, out))
        except (EngineDeadError, RequestFailedError) as e:
            queue.put_nowait((c, e))
        queue.put_nowait((c, None))

    pumps = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        if fmt.chat:
            for c in choices:
                yield _event(fmt.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}],
                                       usage=fmt.choice_usage(c, 0) if continuous else None))
        left = len(choices)
        while left:
            c, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                # Headers are sent already, so the error travels as an event; the openai client raises it.
                code = _failed_code(item) if isinstance(item, RequestFailedError) else "engine_unavailable"
                yield _event({"error": {"message": str(item), "type": "server_error", "code": code, "param": None}})
                break
            else:
                chunk = fmt.stream_chunk(c, item, continuous)
                if chunk is not None:
                    yield _event(chunk)
        else:
            if include_usage:
                yield _event(fmt.chunk([], usage=fmt.usage(choices)))
    finally:
        for p in pumps:
            p.cancel()
        _close_all(choices)
    yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Formatter:
    """OpenAI's response and chunk shapes, for completions (text) or chat (message / delta), with vLLM's
    prompt_logprobs. `drop_output`: max_tokens 0, whose one sampled token is left out."""

    def __init__(self, llm: AsyncLLM, request_id: str, chat: bool, body: SamplingRequest, drop_output: bool = False):
        self.llm, self.request_id, self.chat, self.body = llm, request_id, chat, body
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.echo = not chat and body.echo
        self.drop_output = drop_output

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = {"id": self.request_id, "object": obj, "created": self.created, "model": self.llm.model_name,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def _output(self, out: RequestOutput) -> tuple[str, list[int], list | None]:
        """(text, token ids, logprobs) of the completion, or nothing of it with max_tokens 0."""
        c = out.outputs[0]
        return ("", [], None if c.logprobs is None else []) if self.drop_output else (c.text, c.token_ids, c.logprobs)

    def stream_chunk(self, c: _Choice, out: RequestOutput, continuous: bool) -> dict | None:
        text, token_ids, lps = self._output(out)
        new_ids = [] if self.drop_output else list(out.new_token_ids)
        new_text = "" if self.drop_output else out.new_text
        finish = out.outputs[0].finish_reason if out.finished else None
        first = not c.started
        if not first and not new_text and finish is None and not self.body.return_token_ids and lps is None:
            return None
        c.started = True
        logprobs = self._logprobs(c, lps, token_ids, len(token_ids) - len(new_ids))
        if first and self.echo:
            new_text = self._prompt_text(c, out) + new_text
            if logprobs is not None:
                logprobs = self._merge(self._echo_logprobs(c, out), logprobs)
        choice = {"index": c.index, "logprobs": logprobs, "finish_reason": finish}
        if self.body.return_token_ids:
            choice["token_ids"] = new_ids
        prompt_logprobs = None
        if first and out.prompt_logprobs is not None and self.body.prompt_logprobs is not None:
            prompt_logprobs = self._prompt_logprobs(out)
            if not self.chat:
                choice["prompt_logprobs"] = prompt_logprobs
        if self.chat:
            choice["delta"] = {"content": new_text} if new_text or finish is None else {}
        else:
            choice["text"] = new_text
        chunk = self.chunk([choice], usage=self.choice_usage(c, len(token_ids)) if continuous else None)
        if self.chat and prompt_logprobs is not None:   # beside the choices, as in the response
            chunk["prompt_logprobs"] = prompt_logprobs
        return chunk

    def response(self, choices: list[_Choice]) -> dict:
        out_choices = []
        for c in choices:
            out = c.final
            text, token_ids, lps = self._output(out)
            choice = {"index": c.index, "logprobs": self._logprobs(c, lps, token_ids, 0),
                      "finish_reason": out.outputs[0].finish_reason}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                if self.echo:
                    echoed = self._echo_logprobs(c, out) if choice["logprobs"] is not None else None
                    c.text_offset = 0
                    text = self._prompt_text(c, out) + text
                    if echoed is not None:
                        choice["logprobs"] = self._merge(echoed, self._logprobs(c, lps, token_ids, 0))
                choice["text"] = text
                if self.body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(out)
            if self.body.return_token_ids:
                choice["token_ids"] = list(token_ids)
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
            out_choices.append(choice)
        response = {"id": self.request_id, "object": self.object, "created": self.created,
                    "model": self.llm.model_name, "choices": out_choices, "usage": self.usage(choices)}
        if self.chat and self.body.prompt_logprobs is not None:   # vLLM's chat puts them beside the choices
            response["prompt_logprobs"] = self._prompt_logprobs(choices[0].final)
        return response

    def usage(self, choices: list[_Choice]) -> dict:
        """Each prompt counted once (its n choices share it), every choice's tokens."""
        prompts = {id(c.ids): len(c.ids) for c in choices}
        p = sum(prompts.values())
        g = 0 if self.drop_output else sum(len(c.run.last.outputs[0].token_ids) for c in choices if c.run.last)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

    @staticmethod
    def choice_usage(c: _Choice, num_generated: int) -> dict:
        """vLLM's continuous_usage_stats: one choice's counts so far."""
        return {"prompt_tokens": len(c.ids), "completion_tokens": num_generated,
                "total_tokens": len(c.ids) + num_generated}

    def _token_str(self, token_id: int) -> str:
        tok = self.llm.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else f"token_id:{token_id}"

    def _prompt_text(self, c: _Choice, out: RequestOutput) -> str:
        if c.text is not None:
            return c.text
        return self.llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def _prompt_logprobs(self, out: RequestOutput) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token (the first None), {token id: {logprob, rank, decoded_token}} for
        the token and the top ones."""
        result: list[dict | None] = [None]
        for tid, lp in zip(out.prompt_token_ids[1:], (out.prompt_logprobs or [None])[1:]):
            entry = {str(i): {"logprob": v, "rank": r + 1, "decoded_token": self._token_str(i)}
                     for r, (i, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs))}
            entry.setdefault(str(tid), {"logprob": lp.token_logprob, "rank": lp.token_rank,
                                        "decoded_token": self._token_str(tid)})
            result.append(entry)
        return result

    def _echo_logprobs(self, c: _Choice, out: RequestOutput) -> dict:
        """The prompt's part of an echoed completion's logprobs: its first token's are null, as OpenAI's."""
        tokens = [self._token_str(t) for t in out.prompt_token_ids]
        token_logprobs: list = [None]
        top_logprobs: list = [None]
        for s, lp in zip(tokens[1:], (out.prompt_logprobs or [None])[1:]):
            top = self._top(lp)
            top.setdefault(s, lp.token_logprob)
            token_logprobs.append(lp.token_logprob)
            top_logprobs.append(top)
        offsets = []
        for s in tokens:
            offsets.append(c.text_offset)
            c.text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    @staticmethod
    def _merge(first: dict, then: dict) -> dict:
        return {k: first[k] + then[k] for k in first}

    def _logprobs(self, c: _Choice, lps, token_ids, start: int) -> dict | None:
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
            offsets.append(c.text_offset)
            c.text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": [l.token_logprob for l in lps],
                "top_logprobs": [self._top(l) for l in lps], "text_offset": offsets}

    def _top(self, lp) -> dict[str, float]:
        """A token's top logprobs keyed by text, as OpenAI's: where two tokens read alike (bytes of one
        character), the likelier one's."""
        top: dict[str, float] = {}
        for i, v in zip(lp.top_token_ids, lp.top_logprobs):   # most likely first
            top.setdefault(self._token_str(i), v)
        return top
