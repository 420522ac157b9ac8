"""Which rank this process is, and the torch.distributed groups it talks over.

Parallel layers ask here for their TP group; the PP stage boundary asks for its neighbours.
`rank = pp_rank * tp_size + tp_rank`, so a TP group is a run of consecutive ranks.
"""
from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from devharness.debug import state as debug_state


@dataclass(frozen=True)
class ParallelInfo:
    """This process's place in the tp x pp grid (tp=pp=1 means no torch.distributed at all)."""

    rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    tp_size: int = 1
    pp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        """Only the last stage's TP rank 0 returns sampled tokens."""
        return self.is_last_stage and self.tp_rank == 0

    def rank_of(self, tp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank


_info = ParallelInfo()
_tp_group = None
_tp_peers: list[int] = []   # the other ranks of this TP group


def get_parallel_info() -> ParallelInfo:
    return _info


def set_parallel_info(info: ParallelInfo) -> None:
    """Single-process use (tp=pp=1), or tests that build layers for a given rank without communicating."""
    global _info, _tp_group, _tp_peers
    _info, _tp_group, _tp_peers = info, None, _peers_of(info)


def init_distributed(info: ParallelInfo, init_method: str, backend: str, timeout_s: float) -> None:
    """Join the world and build the TP groups. Every rank must call this with the same arguments."""
    global _info, _tp_group, _tp_peers
    _info, _tp_peers = info, _peers_of(info)
    if info.world_size == 1:
        _tp_group = None
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, init_method=init_method, rank=info.rank,
                            world_size=info.world_size, timeout=timeout)
    # new_group is collective over the whole world: every rank creates every group, in the same order.
    for pp in range(info.pp_size):
        ranks = [info.rank_of(t, pp) for t in range(info.tp_size)]
        group = dist.new_group(ranks, timeout=timeout, backend=backend) if info.tp_size > 1 else None
        if pp == info.pp_rank:
            _tp_group = group


def destroy_distributed() -> None:
    global _tp_group
    _tp_group = None
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _peers_of(info: ParallelInfo) -> list[int]:
    """The other ranks of this rank's TP group."""
    return [info.rank_of(t, info.pp_rank) for t in range(info.tp_size) if t != info.tp_rank]


# Each collective below tells the worker's state recorder (if there is one) that this rank now waits
# in it (which layer, which peers) and when it has left. That is the code right after a wait, on cold
# caches: it is written out in each function rather than behind helpers, one call each way.

def tp_all_reduce(x: torch.Tensor, what: str = "all_reduce") -> torch.Tensor:
    """Sum `x` over this TP group, in place; identity at tp=1. `what` names it in the worker's state."""
    if _info.tp_size == 1:
        return x
    rec = debug_state.recorder
    if rec is None:
        dist.all_reduce(x, group=_tp_group)
        return x
    rec.enter("collective", what, _tp_peers, rec.layer)
    dist.all_reduce(x, group=_tp_group)
    rec.leave()
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each TP rank's shard of the last dimension; identity at tp=1."""
    if _info.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_info.tp_size)]
    rec = debug_state.recorder
    if rec is not None:
        rec.enter("collective", "all_gather logits", _tp_peers)
    dist.all_gather(parts, x.contiguous(), group=_tp_group)
    if rec is not None:
        rec.leave()
    return torch.cat(parts, dim=-1)


def pp_send(tensors: list[torch.Tensor]) -> None:
    """Send this stage's activations to the same TP rank of the next stage."""
    dst = _info.rank_of(_info.tp_rank, _info.pp_rank + 1)
    rec = debug_state.recorder
    if rec is not None:
        rec.enter("send", f"activations to rank {dst}", [dst])
    for t in tensors:
        dist.send(t.contiguous(), dst=dst)
    if rec is not None:
        rec.leave()


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Receive activations from the same TP rank of the previous stage."""
    src = _info.rank_of(_info.tp_rank, _info.pp_rank - 1)
    rec = debug_state.recorder
    if rec is not None:
        rec.enter("recv", f"activations from rank {src}", [src])
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=src)
        out.append(t)
    if rec is not None:
        rec.leave()
    return out
