"""Rank-aware breakpoints: fire only on the worker (rank, tp, pp), step, request or layer they name.

In code: `devharness.debug.breakpoint(rank=1, step=5)`. From outside, `arm()` (reached through the
executor, later POST /debug/break) keeps a one-shot spec that the worker checks at each step start
and, when the spec names a layer, at each layer start.
"""
from __future__ import annotations

import sys
import threading

from devharness.debug import state as debug_state
from devharness.protocol.messages import BreakpointSpec, WorkerState  # noqa: F401  (BreakpointSpec: re-exported)
from devharness.model.hooks import ModelHooks


# Specs armed in this worker; read on every step, written by the control thread.
_armed_lock = threading.Lock()
_armed: list[BreakpointSpec] = []
_step_request_ids: frozenset[str] = frozenset()
layer_armed = False   # fast check in the layer loop


def arm(spec: BreakpointSpec) -> bool:
    """Keep `spec` if it names this worker (or no worker); True if kept."""
    global layer_armed
    rec = debug_state.current_recorder()
    if rec is not None and not spec.matches_worker(rec.state):
        return False
    with _armed_lock:
        _armed.append(spec)
        layer_armed = any(s.layer is not None for s in _armed)
    return True


def clear() -> int:
    global layer_armed
    with _armed_lock:
        n = len(_armed)
        _armed.clear()
        layer_armed = False
    return n


def _take(step: int, layer: int | None) -> BreakpointSpec | None:
    global layer_armed
    with _armed_lock:
        for spec in _armed:
            if spec.layer != layer:
                continue
            if spec.step is not None and spec.step != step:
                continue
            if spec.request_id is not None and spec.request_id not in _step_request_ids:
                continue
            _armed.remove(spec)
            layer_armed = any(s.layer is not None for s in _armed)
            return spec
    return None


def on_step_start(step: int, request_ids) -> None:
    """Called by the model runner before each step; fires a matching armed spec in the caller's frame."""
    global _step_request_ids
    _step_request_ids = frozenset(request_ids)
    if _armed and _take(step, None) is not None:
        from devharness.debug.debugger import pause_here
        pause_here(sys._getframe(1), "breakpoint")


def on_layer_start(layer: int, frame) -> None:
    """Fire a spec armed for `layer` (and this step) in `frame`, the model's layer loop."""
    rec = debug_state.current_recorder()
    step = rec.state.step if rec is not None else 0
    if _take(step, layer) is not None:
        from devharness.debug.debugger import pause_here
        pause_here(frame, "breakpoint")


class LayerWatch(ModelHooks):
    """The model hook a worker installs with its state recorder: the recorder knows the layer running
    (for a hang's site and for `breakpoint(layer=...)`), and a breakpoint or fault armed for a layer
    fires at its start (a breakpoint stops in the model's layer loop)."""

    def __init__(self, recorder: debug_state.StateRecorder):
        self.recorder = recorder

    def layer_start(self, layer: int) -> None:
        self.recorder.layer = layer
        if layer_armed:
            on_layer_start(layer, sys._getframe(1))
        if _faults:
            check_fault(self.recorder.state.step, layer)

    def layers_done(self) -> None:
        self.recorder.layer = None


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
    if request_id is not None and request_id not in _step_request_ids:
        return
    if layer is not None and layer != rec.layer:
        return
    from devharness.debug.debugger import pause_here
    pause_here(sys._getframe(1), "breakpoint")


class InjectedFault(RuntimeError):
    """Raised by a fault armed with `arm_fault`: exercises the failure and post-mortem paths on purpose."""


_faults: list[BreakpointSpec] = []


def arm_fault(spec: BreakpointSpec) -> bool:
    """Raise InjectedFault at the step (and layer) `spec` names, once, on the worker it names."""
    rec = debug_state.current_recorder()
    if rec is not None and not spec.matches_worker(rec.state):
        return False
    with _armed_lock:
        _faults.append(spec)
    return True


def clear_faults() -> None:
    """Forget every armed fault (a worker that shuts down before its step came must not leave it to the next
    worker in this process)."""
    with _armed_lock:
        _faults.clear()


def check_fault(step: int, layer: int | None = None) -> None:
    """Raise a fault armed for this step (at its start, or at `layer`'s start)."""
    if not _faults:
        return
    with _armed_lock:
        spec = next((s for s in _faults if s.layer == layer and (s.step is None or s.step == step)), None)
        if spec is None:
            return
        _faults.remove(spec)
    rec = debug_state.current_recorder()
    where = f"rank {rec.state.rank} " if rec is not None else ""
    raise InjectedFault(f"fault injected on {where}at step {step}" + ("" if layer is None else f", layer {layer}"))


# Faults planted in one request's rows: req id -> where ("prepare" or "sample"); exercises per-request
# failure (the request fails alone, the step goes on). Read on every prepared row: a dict test when empty.
_request_faults: dict[str, str] = {}
REQUEST_FAULT_SITES = {"prepare": "preparing", "sample": "sampling"}


def arm_request_fault(request_id: str, where: str = "prepare") -> bool:
    """Raise InjectedFault whenever this worker prepares (or samples) `request_id`'s rows, until that
    request has failed here (`forget_request_fault`)."""
    if where not in REQUEST_FAULT_SITES:
        raise ValueError(f"request fault site {where!r}: must be one of {', '.join(REQUEST_FAULT_SITES)}")
    with _armed_lock:
        _request_faults[request_id] = where
    return True


def forget_request_fault(request_id: str) -> None:
    if _request_faults:
        with _armed_lock:
            _request_faults.pop(request_id, None)


def request_fault(request_id: str, where: str) -> None:
    if _request_faults and _request_faults.get(request_id) == where:
        raise InjectedFault(f"fault injected in request {request_id!r} while {REQUEST_FAULT_SITES[where]} its rows")
