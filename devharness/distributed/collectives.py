"""The collectives a forward pass needs: TP all-reduce and all-gather, PP send and receive.

The model calls these; it knows nothing of who watches it. Watchers (the worker's state recorder; a planted
stall) register with add_observer() and are told, before and after every wait, what this rank waits in and for
whom: that is how a hang names its site and the peers that never came.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from devharness.distributed import parallel_state as ps


class CollectiveObserver(Protocol):
    layer: int | None   # the decoder layer running now, if the observer knows it

    def enter(self, phase: str, what: str, waiting_for: list[int] | None = None,
              layer: int | None = None) -> None: ...

    def leave(self) -> None: ...


_observers: tuple[CollectiveObserver, ...] = ()


def add_observer(observer: CollectiveObserver, first: bool = False) -> None:
    """Tell `observer` of every wait from now on (once, however often added); `first`: before the others."""
    global _observers
    if observer not in _observers:
        _observers = (observer, *_observers) if first else (*_observers, observer)


def remove_observer(observer: CollectiveObserver) -> None:
    global _observers
    _observers = tuple(o for o in _observers if o is not observer)


# Each collective tells the observers (if any: the worker's state recorder) that this rank now waits in it
# (which layer, which peers) and when it has left. That is the code right after a wait, on cold caches: it is
# written out in each function rather than behind helpers.

def tp_all_reduce(x: torch.Tensor, what: str = "all_reduce") -> torch.Tensor:
    """Sum `x` over this TP group, in place; identity at tp=1. `what` names it in the worker's state."""
    if ps._info.tp_size == 1:
        return x
    observers = _observers
    if not observers:
        dist.all_reduce(x, group=ps._tp_group)
        return x
    for obs in observers:
        obs.enter("collective", what, ps._tp_peers, obs.layer)
    dist.all_reduce(x, group=ps._tp_group)
    for obs in observers:
        obs.leave()
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each TP rank's shard of the last dimension; identity at tp=1."""
    if ps._info.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(ps._info.tp_size)]
    observers = _observers
    for obs in observers:
        obs.enter("collective", "all_gather logits", ps._tp_peers)
    dist.all_gather(parts, x.contiguous(), group=ps._tp_group)
    for obs in observers:
        obs.leave()
    return torch.cat(parts, dim=-1)


def pp_send(tensors: list[torch.Tensor]) -> None:
    """Send this stage's activations to the same TP rank of the next stage. Every stage runs steps in the order
    the driver sent them, so with several batches in flight the k-th send still meets the next stage's k-th recv
    (messages between two ranks arrive in the order they were sent)."""
    dst = ps._info.rank_of(ps._info.tp_rank, ps._info.pp_rank + 1)
    observers = _observers
    for obs in observers:
        obs.enter("send", f"activations to rank {dst}", [dst])
    for t in tensors:
        dist.send(t.contiguous(), dst=dst)
    for obs in observers:
        obs.leave()


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Receive activations from the same TP rank of the previous stage."""
    src = ps._info.rank_of(ps._info.tp_rank, ps._info.pp_rank - 1)
    observers = _observers
    for obs in observers:
        obs.enter("recv", f"activations from rank {src}", [src])
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=src)
        out.append(t)
    for obs in observers:
        obs.leave()
    return out
