"""The debug API as the TUI sees it: an httpx client for /debug/* and /v1/completions that decodes
into the wire types of devharness.protocol.messages, and `follow`, the reconnecting feed that a Textual worker runs.

The TUI only ever talks to a `DebugClient`, so tests inject a fake that serves canned snapshots.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, Protocol
from urllib.parse import quote

import httpx
import msgspec
from textual.message import Message

from devharness.protocol.json_codecs import (bundle_written_decoder, kv_decoder, read_history, read_ledger,
                                             requests_decoder, snapshot_decoder, story_decoder)
from devharness.protocol.messages import KvSnapshot, Ledger, RequestsSnapshot, RequestStory, Snapshot, StepRecord


class Completion(msgspec.Struct, frozen=True):
    text: str
    num_tokens: int | None


class DebugApiError(Exception):
    """The server answered, but not with what the debug API promises."""


class StreamUnsupported(DebugApiError):
    """The server has /debug/workers but no /debug/stream: poll instead."""


class DebugClient(Protocol):
    """Everything the TUI asks of a debug server. Methods raise httpx.HTTPError when the
    server is unreachable and DebugApiError when it answers with an error or a wrong shape."""

    base_url: str

    async def snapshot(self) -> Snapshot: ...
    def stream(self) -> AsyncIterator[Snapshot]: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def step(self, n: int = 1) -> None: ...
    async def arm_break(self, rank: int | None = None, step: int | None = None,
                        layer: int | None = None) -> None: ...
    async def release(self, rank: int | None = None) -> list[int]: ...   # the ranks let go
    async def stack(self, rank: int) -> str: ...
    async def bundle(self) -> str: ...   # where the server wrote it
    async def history(self, rank: int) -> list[StepRecord] | None: ...   # None: no such route
    async def logs(self, rank: int) -> list[str] | None: ...
    async def collectives(self, rank: int, last: int = 64) -> Ledger | None: ...   # None: no such route
    async def complete(self, prompt: str, max_tokens: int) -> Completion: ...
    async def kv(self) -> KvSnapshot: ...   # the KV cache map (GET /debug/kv)
    async def requests(self) -> RequestsSnapshot: ...   # every request and why it waits (GET /debug/requests)
    async def request_story(self, request_id: str) -> RequestStory | None: ...   # None: no such request
    async def timeline(self, steps: int | None = None) -> dict | None: ...   # GET /debug/timeline; None: no route
    async def aclose(self) -> None: ...


class _Released(msgspec.Struct):
    released: list[int]


class _Stack(msgspec.Struct):
    stacks: str


class _Logs(msgspec.Struct):
    lines: list[str]


class _Choice(msgspec.Struct):
    text: str


class _Usage(msgspec.Struct):
    completion_tokens: int | None = None


class _CompletionResponse(msgspec.Struct):
    choices: list[_Choice]
    usage: _Usage | None = None


# The replies that are this client's own shapes; the wire's types have protocol's decoders (json_codecs.py).
_released_decoder = msgspec.json.Decoder(_Released, strict=False)
_stack_decoder = msgspec.json.Decoder(_Stack, strict=False)
_logs_decoder = msgspec.json.Decoder(_Logs, strict=False)
_completion_decoder = msgspec.json.Decoder(_CompletionResponse, strict=False)


def _decode(body: bytes | str, decode: Callable, what: str):
    """`decode(body)`: a decoder's decode or a protocol reader; DebugApiError where the body is not what it reads."""
    try:
        return decode(body)
    except msgspec.DecodeError as e:
        raise DebugApiError(f"{what}: unexpected response ({e})") from None


class HttpDebugClient:
    """DebugClient over HTTP; pass `transport` (e.g. httpx.MockTransport) to test the routes. `token` (the
    server's debug token) goes with every /debug request, `api_key` with every /v1 one."""

    # A stream with no event for this long is reopened; idle servers send nothing "on change".
    STREAM_IDLE_S = 30.0

    def __init__(self, base_url: str, transport: httpx.AsyncBaseTransport | None = None,
                 token: str | None = None, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, transport=transport,
                                       timeout=httpx.Timeout(5.0))
        self._model: str | None = None
        self._tokens = {"/debug": token, "/v1": api_key}

    def _auth(self, path: str) -> dict[str, str]:
        token = next((t for prefix, t in self._tokens.items() if path.startswith(prefix)), None)
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def _request(self, method: str, path: str, json: dict | None = None,
                       missing_ok: bool = False, timeout_s: float | None = None) -> httpx.Response | None:
        kw = {} if timeout_s is None else {"timeout": timeout_s}
        resp = await self._http.request(method, path, json=json, headers=self._auth(path), **kw)
        if missing_ok and resp.status_code == 404:
            return None
        if resp.status_code == 404 and path.startswith("/debug"):
            raise DebugApiError(f"{method} {path}: 404 (is the server running with --debug?)")
        if resp.is_error:
            raise DebugApiError(f"{method} {path}: {resp.status_code} {_error_text(resp)}")
        return resp

    async def snapshot(self) -> Snapshot:
        resp = await self._request("GET", "/debug/workers")
        return _decode(resp.content, snapshot_decoder.decode, "GET /debug/workers")

    async def stream(self) -> AsyncIterator[Snapshot]:
        timeout = httpx.Timeout(5.0, read=self.STREAM_IDLE_S)
        async with self._http.stream("GET", "/debug/stream", timeout=timeout, headers=self._auth("/debug")) as resp:
            if resp.status_code == 404:
                raise StreamUnsupported("GET /debug/stream: 404")
            if resp.is_error:
                await resp.aread()
                raise DebugApiError(f"GET /debug/stream: {resp.status_code} {_error_text(resp)}")
            data: list[str] = []
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
                elif not line and data:   # a blank line ends one event
                    yield _decode("\n".join(data), snapshot_decoder.decode, "GET /debug/stream")
                    data = []

    async def pause(self) -> None:
        await self._request("POST", "/debug/engine/pause")

    async def resume(self) -> None:
        await self._request("POST", "/debug/engine/resume")

    async def step(self, n: int = 1) -> None:
        await self._request("POST", "/debug/engine/step", json={"n": n})

    async def arm_break(self, rank: int | None = None, step: int | None = None,
                        layer: int | None = None) -> None:
        body = {k: v for k, v in (("rank", rank), ("step", step), ("layer", layer)) if v is not None}
        await self._request("POST", "/debug/break", json=body)

    async def release(self, rank: int | None = None) -> list[int]:
        resp = await self._request("POST", "/debug/release", json={} if rank is None else {"rank": rank})
        return _decode(resp.content, _released_decoder.decode, "POST /debug/release").released

    async def bundle(self) -> str:
        resp = await self._request("POST", "/debug/bundle", timeout_s=120.0)   # py-spy reads every rank
        return _decode(resp.content, bundle_written_decoder.decode, "POST /debug/bundle").path

    async def kv(self) -> KvSnapshot:
        resp = await self._request("GET", "/debug/kv")
        return _decode(resp.content, kv_decoder.decode, "GET /debug/kv")

    async def requests(self) -> RequestsSnapshot:
        resp = await self._request("GET", "/debug/requests")
        return _decode(resp.content, requests_decoder.decode, "GET /debug/requests")

    async def request_story(self, request_id: str) -> RequestStory | None:
        resp = await self._request("GET", f"/debug/requests/{quote(request_id, safe='')}", missing_ok=True)
        return None if resp is None else _decode(resp.content, story_decoder.decode, "GET /debug/requests/{id}")

    async def timeline(self, steps: int | None = None) -> dict | None:
        resp = await self._request("GET", "/debug/timeline" + (f"?steps={steps}" if steps else ""), missing_ok=True)
        return None if resp is None else _decode(resp.content, msgspec.json.decode, "GET /debug/timeline")

    async def stack(self, rank: int) -> str:
        resp = await self._request("GET", f"/debug/workers/{rank}/stack")
        return _decode(resp.content, _stack_decoder.decode, "GET stack").stacks

    async def history(self, rank: int) -> list[StepRecord] | None:
        resp = await self._request("GET", f"/debug/workers/{rank}/history", missing_ok=True)
        if resp is None:
            return None
        return _decode(resp.content, read_history, "GET history")

    async def logs(self, rank: int) -> list[str] | None:
        resp = await self._request("GET", f"/debug/workers/{rank}/logs", missing_ok=True)
        return None if resp is None else _decode(resp.content, _logs_decoder.decode, "GET logs").lines

    async def collectives(self, rank: int, last: int = 64) -> Ledger | None:
        resp = await self._request("GET", f"/debug/workers/{rank}/collectives?last={last}", missing_ok=True)
        return None if resp is None else _decode(resp.content, read_ledger, "GET collectives")

    async def complete(self, prompt: str, max_tokens: int) -> Completion:
        if self._model is None:
            self._model = await self._served_model()
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        if self._model:
            body["model"] = self._model
        # Generation can outlast the API timeout, above all while a worker sits at a breakpoint.
        resp = await self._http.post("/v1/completions", json=body, timeout=None, headers=self._auth("/v1"))
        if resp.is_error:
            raise DebugApiError(f"POST /v1/completions: {resp.status_code} {_error_text(resp)}")
        out = _decode(resp.content, _completion_decoder.decode, "POST /v1/completions")
        if not out.choices:
            raise DebugApiError("POST /v1/completions: no choices in the response")
        return Completion(text=out.choices[0].text,
                          num_tokens=out.usage.completion_tokens if out.usage else None)

    async def _served_model(self) -> str:
        """The first model /v1/models lists; "" leaves `model` out of the request."""
        resp = await self._request("GET", "/v1/models", missing_ok=True)
        try:
            return resp.json()["data"][0]["id"] if resp is not None else ""
        except (ValueError, LookupError, TypeError):
            return ""

    async def aclose(self) -> None:
        await self._http.aclose()


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(body, dict):
        err = body.get("error") or body.get("detail")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err:
            return str(err)
    return str(body)[:200]


class SnapshotReceived(Message):
    """A fresh snapshot. Only the newest queued one matters, so a burst costs one redraw."""

    def __init__(self, snapshot: Snapshot) -> None:
        super().__init__()
        self.snapshot = snapshot

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, SnapshotReceived)


class ConnectionChanged(Message):
    """The feed connected, or lost the server and retries after `retry_in_s`."""

    def __init__(self, connected: bool, reason: str = "", retry_in_s: float | None = None) -> None:
        super().__init__()
        self.connected = connected
        self.reason = reason
        self.retry_in_s = retry_in_s


async def follow(client: DebugClient, post: Callable[[Message], object], *,
                 retry_s: float = 0.5, max_retry_s: float = 5.0, poll_s: float = 0.25,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
    """Post snapshots until cancelled: one GET, then the SSE stream (or polling at `poll_s`
    where there is none); on failure post ConnectionChanged and retry with doubling backoff."""
    delay = retry_s
    while True:
        try:
            first = await client.snapshot()
            post(ConnectionChanged(True))
            post(SnapshotReceived(first))
            delay = retry_s
            try:
                async for snapshot in client.stream():
                    post(SnapshotReceived(snapshot))
            except StreamUnsupported:
                while True:
                    await sleep(poll_s)
                    post(SnapshotReceived(await client.snapshot()))
            except httpx.ReadTimeout:
                continue   # an idle stream, not a lost server: reopen without a banner
            await sleep(retry_s)   # the server closed the stream; don't spin if it keeps doing so
        except (httpx.HTTPError, DebugApiError) as e:
            post(ConnectionChanged(False, reason=str(e) or type(e).__name__, retry_in_s=delay))
            await sleep(delay)
            delay = min(delay * 2, max_retry_s)
