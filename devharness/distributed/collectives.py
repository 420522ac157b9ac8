"""The collectives a forward pass needs: TP all-reduce and all-gather, PP send and receive.

The model calls these; it knows nothing of who watches it. A watcher (the worker's state recorder)
registers with set_observer() and is told, for every wait, what this rank waits in and for whom: that
is how a hang names its site and the peers that never came.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.distributed as dist

from devharness.distributed import parallel_state as ps


class CollectiveObserver(Protocol):
    layer: int | None   # the decoder layer running now, if any

    def enter(self, phase: str, what: str, waiting_for: list[int] | None = None,
              layer: int | None = None) -> None: ...

    def leave(self) -> None: ...


_observer: CollectiveObserver | None = None
# A planted bug (debug/faults.py, `--inject`): called with the all-reduce's name; True makes this rank keep
# its own partial sum instead of the all-reduce's result. None outside fault injection.
_fault: Callable[[str], bool] | None = None


def set_observer(observer: CollectiveObserver | None) -> None:
    global _observer
    _observer = observer


def set_fault(fault: Callable[[str], bool] | None) -> None:
    global _fault
    _fault = fault


# Each collective tells the observer (if one is set: the worker's state recorder) that this rank now
# waits in it (which layer, which peers) and when it has left. That is the code right after a wait, on
# cold caches: it is written out in each function rather than behind helpers, one call each way.

def tp_all_reduce(x: torch.Tensor, what: str = "all_reduce") -> torch.Tensor:
    """Sum `x` over this TP group, in place; identity at tp=1. `what` names it in the worker's state."""
    if ps._info.tp_size == 1:
        return x
    # A planted bug takes part (the peers must not hang) but keeps this rank's own partial sum.
    own = x.clone() if _fault is not None and _fault(what) else None
    obs = _observer
    if obs is None:
        dist.all_reduce(x, group=ps._tp_group)
    else:
        obs.enter("collective", what, ps._tp_peers, obs.layer)
        dist.all_reduce(x, group=ps._tp_group)
        obs.leave()
    return x if own is None else x.copy_(own)


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each TP rank's shard of the last dimension; identity at tp=1."""
    if ps._info.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(ps._info.tp_size)]
    obs = _observer
    if obs is not None:
        obs.enter("collective", "all_gather logits", ps._tp_peers)
    dist.all_gather(parts, x.contiguous(), group=ps._tp_group)
    if obs is not None:
        obs.leave()
    return torch.cat(parts, dim=-1)


def pp_send(tensors: list[torch.Tensor]) -> None:
    """Send this stage's activations to the same TP rank of the next stage. Every stage runs steps in the order
    the driver sent them, so with several batches in flight the k-th send still meets the next stage's k-th recv
    (messages between two ranks arrive in the order they were sent)."""
    dst = ps._info.rank_of(ps._info.tp_rank, ps._info.pp_rank + 1)
    if _fault is not None:
        _fault("send")   # a planted stall may hold this rank here
    obs = _observer
    if obs is not None:
        obs.enter("send", f"activations to rank {dst}", [dst])
    for t in tensors:
        dist.send(t.contiguous(), dst=dst)
    if obs is not None:
        obs.leave()


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Receive activations from the same TP rank of the previous stage."""
    src = ps._info.rank_of(ps._info.tp_rank, ps._info.pp_rank - 1)
    if _fault is not None:
        _fault("recv")
    obs = _observer
    if obs is not None:
        obs.enter("recv", f"activations from rank {src}", [src])
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=src)
        out.append(t)
    if obs is not None:
        obs.leave()
    return out
