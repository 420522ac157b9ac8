"""Clients that stop sending never hold a connection. uvicorn bounds only the idle time between requests
(timeout_keep_alive): a request whose body stops coming, or whose headers do, would wait forever, and enough
of them hold every connection the server has. BodyTimeout answers a stalled body 408 and closes the connection;
HeaderTimeoutH11 closes a connection whose request headers do not all arrive in time (no request has begun, so
there is nothing to answer)."""
from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol


class BodyTimeout:
    """408 when the request body's next chunk takes longer than `idle_s`, or the whole body longer than `total_s`
    (a trickle). Once the body is in, `receive` only waits for a disconnect, however long the response takes."""

    def __init__(self, app, idle_s: float, total_s: float):
        self.check(idle_s, total_s)
        self.app, self.idle_s, self.total_s = app, idle_s, total_s

    @staticmethod
    def check(idle_s: float, total_s: float) -> None:
        """Starlette builds middleware at the first request: build_app checks the values when it is called."""
        if not 0 < idle_s <= total_s:
            raise ValueError(f"body timeouts {idle_s!r} s idle, {total_s!r} s in all: need 0 < idle <= total")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_s
        body_in = False

        async def timed_receive():
            nonlocal body_in
            if body_in:
                return await receive()
            wait = min(self.idle_s, deadline - loop.time())
            try:
                message = await asyncio.wait_for(receive(), max(wait, 0))
            except asyncio.TimeoutError:
                # FastAPI re-raises HTTPException from body reading; the error handlers give it OpenAI's shape.
                # The rest of the body may still come: the connection closes after the answer.
                raise StarletteHTTPException(408, f"the request body did not arrive in time (at most {self.idle_s:g} "
                                                  f"s between its parts, {self.total_s:g} s in all)",
                                             headers={"Connection": "close"}) from None
            body_in = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        return await self.app(scope, timed_receive, send)


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request's headers are not all in `header_timeout_s`
    after it opened or after its last response (subclass it with the value: header_timeout_protocol)."""

    header_timeout_s: float = 30.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(None)

    def on_response_complete(self) -> None:
        finished = self.cycle
        super().on_response_complete()   # may begin a pipelined request, a new cycle
        self._arm(finished)

    def connection_lost(self, exc) -> None:
        self._arm(None, start=False)
        super().connection_lost(exc)

    def _arm(self, cycle, start: bool = True) -> None:
        # The request whose headers are awaited has begun once `self.cycle` is another than `cycle`.
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expire, cycle) if start else None

    def _expire(self, cycle) -> None:
        if self.cycle is cycle and not self.transport.is_closing():
            self.transport.close()   # connection_lost follows, as for uvicorn's own keep-alive timeout


def header_timeout_protocol(timeout_s: float) -> type[HeaderTimeoutH11]:
    if not timeout_s > 0:
        raise ValueError(f"header timeout {timeout_s!r} s: must be > 0")
    return type("HeaderTimeoutH11", (HeaderTimeoutH11,), {"header_timeout_s": timeout_s})
