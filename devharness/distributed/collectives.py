"""The collectives a forward pass needs: TP all-reduce and all-gather, PP send and receive.

The model calls these; it knows nothing of who watches it. Each worker keeps its watchers in its own Observers
and makes them the ones told, for the calls it runs, with `observed(observers)` (a context reset in finally: two
engines in one process never see each other's ops). They are told of every op, by what they define:

- `enter(phase, what, waiting_for, layer)` / `leave()`: this rank now waits in a collective (which layer, for
  whom) and has left it: the worker's state recorder, a planted stall. That is how a hang names its site and
  the peers that never came.
- `on_call(call)` / `on_done(call)`: the op itself (a Call: op, group, tensor, site) before it is made and once
  it has returned: the collective ledger (debug/ledger.py) enters it; a planted fault may change it first
  (another tensor, or none: `call.skip`). With `set_async(True)` an op is issued with `async_op=True`: on_done
  gets its Work (`call.work`), and the caller waits on it where the result is used, outside the call (as a
  host thread does on CUDA, where a collective returns once queued). A blocking op on CUDA tensors (NCCL) comes
  with its Work too: its call returns once it is queued, so only the Work can say when it is done.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Protocol

import torch
import torch.distributed as dist

from devharness.distributed import parallel_state as ps

# The groups an op goes over, as the ledger indexes them (parallel_state.groups()).
WORLD, TP, PP = 0, 1, 2


class CollectiveObserver(Protocol):
    layer: int | None   # the decoder layer running now, if the observer knows it

    def enter(self, phase: str, what: str, waiting_for: list[int] | None = None,
              layer: int | None = None) -> None: ...

    def leave(self) -> None: ...


class CallObserver(Protocol):
    def on_call(self, call: "Call") -> None: ...

    def on_done(self, call: "Call") -> None: ...


class Call:
    """One op as the call observers see it: `op` (all_reduce, all_gather, send, recv) over `group` (WORLD, TP, PP)
    on `tensor` (what is sent or reduced; a recv's buffer), `out_shape` where the output is shaped otherwise
    (all_gather: [tp, *shape]), `peer` a send's or receive's other rank, `site` what the model calls it. An
    observer may set `tensor` (another one is sent) or `skip` (the op is not made); the ledger sets `entry`."""

    __slots__ = ("op", "group", "tensor", "out_shape", "peer", "site", "skip", "entry", "work", "waited")

    def __init__(self, op: str, group: int, tensor: torch.Tensor, site: str, out_shape=None, peer: int | None = None):
        self.op, self.group, self.tensor, self.site, self.out_shape, self.peer = op, group, tensor, site, out_shape, peer
        self.skip = False
        self.entry: int | None = None
        self.work = None
        self.waited = False   # its Work was waited on in the call (a blocking op on CUDA)


class Observers:
    """One worker's collective watchers: `observers` are told enter/leave, `calls` on_call/on_done."""

    __slots__ = ("observers", "calls")

    def __init__(self) -> None:
        self.observers: tuple[CollectiveObserver, ...] = ()
        self.calls: tuple[CallObserver, ...] = ()

    def add(self, observer, first: bool = False) -> None:
        """Tell `observer` of every op from now on (once, however often added): its enter/leave, its
        on_call/on_done, whichever it has; `first`: before the others."""
        if hasattr(observer, "enter") and observer not in self.observers:
            self.observers = (observer, *self.observers) if first else (*self.observers, observer)
        if hasattr(observer, "on_call") and observer not in self.calls:
            self.calls = (observer, *self.calls) if first else (*self.calls, observer)

    def remove(self, observer) -> None:
        self.observers = tuple(o for o in self.observers if o is not observer)
        self.calls = tuple(o for o in self.calls if o is not observer)


_async = False
_NONE = Observers()   # never added to: what an op sees outside any worker's scope
_current: ContextVar[Observers] = ContextVar("devharness_collective_observers", default=_NONE)


@contextlib.contextmanager
def observed(observers: Observers):
    """Tell `observers` of the ops this thread makes inside the block."""
    token = _current.set(observers)
    try:
        yield observers
    finally:
        _current.reset(token)


def set_async(on: bool) -> None:
    """Issue the collectives with async_op=True and wait where the result is used (--async-collectives)."""
    global _async
    _async = on


def is_async() -> bool:
    return _async


def await_result(call: Call) -> None:
    """Where an async op's result is used: wait on its Work. The host thread waits here, not in the op's call; the
    state recorder is not told (on CUDA the host would not wait at all): the ledger says what is outstanding."""
    if call.work is not None and not call.waited:
        call.work.wait()


def _made(call: Call, issue, blocking: bool) -> None:
    """Tell the call observers, make the op (unless one skipped it), tell them it returned. `issue(tensor,
    async_op)` makes it and returns its Work where async_op. A blocking op on the CPU (gloo) is done when its call
    returns. On CUDA (NCCL) a blocking call returns once the op is queued on the device: it is issued async and
    waited on here, which is all torch's blocking call does (the current stream waits for it), and the observers
    get its Work, so that the ledger completes the op when the Work does, not when the host moves on."""
    calls = _current.get().calls
    for c in calls:
        c.on_call(call)
    if not call.skip:
        t = call.tensor
        if blocking and not t.is_cuda:
            issue(t, False)
        else:
            call.work = issue(t, True)
            if blocking:
                call.work.wait()
                call.waited = True
    for c in calls:
        c.on_done(call)


# Each collective tells the observers (if any: the worker's state recorder) that this rank now waits in it
# (which layer, which peers) and when it has left. That is the code right after a wait, on cold caches: it is
# written out in each function rather than behind helpers.

def tp_all_reduce(x: torch.Tensor, what: str = "all_reduce") -> torch.Tensor:
    """Sum `x` over this TP group, in place; identity at tp=1. `what` names it in the worker's state."""
    if ps._info.tp_size == 1:
        return x
    watchers = _current.get()
    observers = watchers.observers
    if not observers and not watchers.calls and not _async:
        dist.all_reduce(x, group=ps._tp_group)
        return x
    for obs in observers:
        obs.enter("collective", what, ps._tp_peers, obs.layer)
    call = Call("all_reduce", TP, x, what)
    _made(call, lambda t, a: dist.all_reduce(t, group=ps._tp_group, async_op=a), not _async)
    for obs in observers:
        obs.leave()
    await_result(call)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each TP rank's shard of the last dimension; identity at tp=1."""
    if ps._info.tp_size == 1:
        return x
    n = ps._info.tp_size
    parts = [torch.empty_like(x) for _ in range(n)]
    observers = _current.get().observers
    for obs in observers:
        obs.enter("collective", "all_gather logits", ps._tp_peers)
    call = Call("all_gather", TP, x.contiguous(), "all_gather logits", out_shape=(n, *x.shape))
    _made(call, lambda t, a: dist.all_gather(parts, t, group=ps._tp_group, async_op=a), not _async)
    for obs in observers:
        obs.leave()
    await_result(call)
    return torch.cat(parts, dim=-1)


def pp_send(tensors: list[torch.Tensor]) -> None:
    """Send this stage's activations to the same TP rank of the next stage. Every stage runs steps in the order
    the driver sent them, so with several batches in flight the k-th send still meets the next stage's k-th recv
    (messages between two ranks arrive in the order they were sent)."""
    dst = ps._info.rank_of(ps._info.tp_rank, ps._info.pp_rank + 1)
    observers = _current.get().observers
    what = f"activations to rank {dst}"
    for obs in observers:
        obs.enter("send", what, [dst])
    def send(t: torch.Tensor, async_op: bool):
        return dist.isend(t, dst=dst, group=ps._pp_group) if async_op else dist.send(t, dst=dst, group=ps._pp_group)
    for t in tensors:
        _made(Call("send", PP, t.contiguous(), what, peer=dst), send, True)
    for obs in observers:
        obs.leave()


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Receive activations from the same TP rank of the previous stage."""
    src = ps._info.rank_of(ps._info.tp_rank, ps._info.pp_rank - 1)
    observers = _current.get().observers
    what = f"activations from rank {src}"
    for obs in observers:
        obs.enter("recv", what, [src])
    def recv(t: torch.Tensor, async_op: bool):   # dist.recv returns the sender, not a Work
        return dist.irecv(t, src=src, group=ps._pp_group) if async_op else dist.recv(t, src=src, group=ps._pp_group)
    out = []
    for shape in shapes:
        call = Call("recv", PP, torch.empty(shape, dtype=dtype, device=device), what, peer=src)
        _made(call, recv, True)
        out.append(call.tensor)
    for obs in observers:
        obs.leave()
    return out
