"""Rank-aware breakpoints: fire only on the worker (rank, tp, pp), step, request or layer they name.

In code: `devharness.debug.breakpoint(rank=1, step=5)`. From outside, a worker's Breakpoints `arm()` (reached
through the executor, later POST /debug/break) keeps a one-shot spec that the worker checks at each step start
and, when the spec names a layer, at each layer start. Each worker owns its Breakpoints (with its armed faults):
the runner tells it of each step and each request's rows as it tells any step watcher, and the LayerWatch it
installs on its model's hooks tells it of each layer; nothing here is shared by two engines in one process.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from contextvars import ContextVar

from devharness.debug import state as debug_state
from devharness.protocol.messages import BreakpointSpec, WorkerState  # noqa: F401  (BreakpointSpec: re-exported)
from devharness.model.hooks import ModelHooks


class InjectedFault(RuntimeError):
    """Raised by a fault armed with `arm_fault`: exercises the failure and post-mortem paths on purpose."""


REQUEST_FAULT_SITES = {"prepare": "preparing", "sample": "sampling"}


class Breakpoints:
    """One worker's armed specs, read on every step (a list test when none), written by the control thread; a step
    watcher of its runner (step_start, rows, request_done)."""

    def __init__(self, recorder: debug_state.StateRecorder | None = None) -> None:
        self.recorder = recorder
        self._lock = threading.Lock()
        self._armed: list[BreakpointSpec] = []
        self.step_request_ids: frozenset[str] = frozenset()
        self.layer_armed = False   # fast check in the layer loop
        self.faults: list[BreakpointSpec] = []
        # Faults planted in one request's rows: req id -> where ("prepare" or "sample"); exercises per-request
        # failure (the request fails alone, the step goes on). Read on every prepared row: a dict test when empty.
        self.request_faults: dict[str, str] = {}

    def _names_me(self, spec: BreakpointSpec) -> bool:
        return self.recorder is None or spec.matches_worker(self.recorder.state)

    def arm(self, spec: BreakpointSpec) -> bool:
        """Keep `spec` if it names this worker (or no worker); True if kept."""
        if not self._names_me(spec):
            return False
        with self._lock:
            self._armed.append(spec)
            self.layer_armed = any(s.layer is not None for s in self._armed)
        return True

    def clear(self) -> int:
        with self._lock:
            n = len(self._armed)
            self._armed.clear()
            self.layer_armed = False
        return n

    def _take(self, step: int, layer: int | None) -> BreakpointSpec | None:
        with self._lock:
            for spec in self._armed:
                if spec.layer != layer:
                    continue
                if spec.step is not None and spec.step != step:
                    continue
                if spec.request_id is not None and spec.request_id not in self.step_request_ids:
                    continue
                self._armed.remove(spec)
                self.layer_armed = any(s.layer is not None for s in self._armed)
                return spec
        return None

    # -- as the runner's step watcher ---------------------------------------------------------

    def step_start(self, step: int, request_ids) -> None:
        """Before each step: fire a matching armed spec in the caller's frame (the runner's), then raise a fault
        armed for this step."""
        self.step_request_ids = frozenset(request_ids)
        if self._armed and self._take(step, None) is not None:
            from devharness.debug.debugger import pause_here
            pause_here(sys._getframe(1), "breakpoint")
        if self.faults:
            self.check_fault(step)

    def rows(self, request_id: str, where: str) -> None:
        """The runner prepares (or samples) `request_id`'s rows: raise a request fault armed there."""
        if self.request_faults and self.request_faults.get(request_id) == where:
            raise InjectedFault(f"fault injected in request {request_id!r} while {REQUEST_FAULT_SITES[where]} "
                                f"its rows")

    def request_done(self, request_id: str) -> None:
        """That request failed here: its request fault is spent."""
        if self.request_faults:
            with self._lock:
                self.request_faults.pop(request_id, None)

    def on_layer_start(self, layer: int, frame) -> None:
        """Fire a spec armed for `layer` (and this step) in `frame`, the model's layer loop."""
        step = self.recorder.state.step if self.recorder is not None else 0
        if self._take(step, layer) is not None:
            from devharness.debug.debugger import pause_here
            pause_here(frame, "breakpoint")

    # -- faults -------------------------------------------------------------------------------

    def arm_fault(self, spec: BreakpointSpec) -> bool:
        """Raise InjectedFault at the step (and layer) `spec` names, once, on the worker it names."""
        if not self._names_me(spec):
            return False
        with self._lock:
            self.faults.append(spec)
        return True

    def clear_faults(self) -> None:
        with self._lock:
            self.faults.clear()

    def check_fault(self, step: int, layer: int | None = None) -> None:
        """Raise a fault armed for this step (at its start, or at `layer`'s start)."""
        if not self.faults:
            return
        with self._lock:
            spec = next((s for s in self.faults if s.layer == layer and (s.step is None or s.step == step)), None)
            if spec is None:
                return
            self.faults.remove(spec)
        rec = self.recorder
        where = f"rank {rec.state.rank} " if rec is not None else ""
        raise InjectedFault(f"fault injected on {where}at step {step}" + ("" if layer is None else f", layer {layer}"))

    def arm_request_fault(self, request_id: str, where: str = "prepare") -> bool:
        """Raise InjectedFault whenever this worker prepares (or samples) `request_id`'s rows, until that
        request has failed here (`request_done`)."""
        if where not in REQUEST_FAULT_SITES:
            raise ValueError(f"request fault site {where!r}: must be one of {', '.join(REQUEST_FAULT_SITES)}")
        with self._lock:
            self.request_faults[request_id] = where
        return True


class LayerWatch(ModelHooks):
    """The model hook a worker installs on its own model with its state recorder: the recorder knows the layer
    running (for a hang's site and for `breakpoint(layer=...)`), and a breakpoint or fault armed for a layer
    fires at its start (a breakpoint stops in the model's layer loop)."""

    def __init__(self, recorder: debug_state.StateRecorder, breakpoints: Breakpoints):
        self.recorder, self.breakpoints = recorder, breakpoints

    def layer_start(self, layer: int) -> None:
        self.recorder.layer = layer
        bp = self.breakpoints
        if bp.layer_armed:
            bp.on_layer_start(layer, sys._getframe(1))
        if bp.faults:
            bp.check_fault(self.recorder.state.step, layer)

    def layers_done(self) -> None:
        self.recorder.layer = None


# The Breakpoints of the worker whose step runs in this thread, for `breakpoint()` in code: set by the worker
# around each step (scope), reset in finally.
_current: ContextVar[Breakpoints | None] = ContextVar("devharness_breakpoints", default=None)


@contextlib.contextmanager
def scope(breakpoints: Breakpoints):
    token = _current.set(breakpoints)
    try:
        yield breakpoints
    finally:
        _current.reset(token)


def breakpoint(rank: int | None = None, tp_rank: int | None = None, pp_rank: int | None = None,
               step: int | None = None, request_id: str | None = None, layer: int | None = None) -> None:
    """Pause here, under a debugger, only on the worker and step (request, layer) named."""
    rec = debug_state.current_recorder()
    if rec is None:
        return
    spec = BreakpointSpec(rank=rank, tp_rank=tp_rank, pp_rank=pp_rank, step=step, request_id=request_id,
                          layer=layer)
    st = rec.state
    if not spec.matches_worker(st):
        return
    if step is not None and step != st.step:
        return
    bp = _current.get()
    if request_id is not None and (bp is None or request_id not in bp.step_request_ids):
        return
    if layer is not None and layer != rec.layer:
        return
    from devharness.debug.debugger import pause_here
    pause_here(sys._getframe(1), "breakpoint")
