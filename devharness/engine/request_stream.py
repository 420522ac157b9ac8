"""What AsyncLLM's callers await, filled from the engine loop's thread: a request's stream of outputs
and a waiter for a step boundary. Both hop threads only through `loop.call_soon_threadsafe`."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from devharness.engine.output import RequestOutput


class RequestStream:
    """One request's outputs as an async iterator; `abort()` ends it early and frees its KV blocks."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], on_abort: Callable[["RequestStream"], None]):
        """`on_abort(stream)` tells the engine to drop the request (any thread)."""
        self.request_id, self.prompt_token_ids, self.finished = request_id, prompt_token_ids, False
        self._on_abort, self._loop, self._queue = on_abort, asyncio.get_running_loop(), asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Idempotent; a no-op once the request has finished."""
        if not self.finished:
            self.finished = True
            self._on_abort(self)


class StepWaiter:
    """A caller awaiting a step boundary: any boundary (target None) or `target` credited steps."""

    def __init__(self, target: int | None = None):
        self.loop = asyncio.get_running_loop()
        self.future, self.target = self.loop.create_future(), target

    def settle(self, result=None, error: BaseException | None = None) -> None:
        def set_():
            if not self.future.done():
                self.future.set_exception(error) if error else self.future.set_result(result)
        try:
            self.loop.call_soon_threadsafe(set_)
        except RuntimeError:
            pass


def deliver(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    """Run on the callers' loop: one call per loop per step, so a step's outputs arrive together."""
    for stream, out in items:
        stream._queue.put_nowait(out)
