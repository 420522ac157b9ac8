"""Which rank this process is, and the torch.distributed groups it talks over.

Parallel layers ask here for their place in the grid; the collectives (collectives.py) for their TP
group and their PP neighbours. `rank = pp_rank * tp_size + tp_rank`, so a TP group is a run of
consecutive ranks.
"""
from __future__ import annotations

import contextlib
import datetime
import socket
from dataclasses import dataclass

import torch.distributed as dist

from devharness.distributed.rendezvous import Rendezvous, bind_backends, tcp_store


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
_pp_group = None            # this TP rank's ranks across the stages: the PP sends and receives go over it


@dataclass(frozen=True)
class GroupInfo:
    """A process group as torch names it (its name, and the description it was made with) and its global ranks."""

    name: str
    desc: str
    ranks: tuple[int, ...]


# This rank's groups, by the index the collective ledger uses (collectives.WORLD, TP, PP): the world, its TP
# group, its PP group. Without torch.distributed (tp = pp = 1) they are named as torch would name them.
_groups: tuple[GroupInfo, ...] = ()


def get_parallel_info() -> ParallelInfo:
    return _info


def set_parallel_info(info: ParallelInfo) -> None:
    """Single-process use (tp=pp=1), or tests that build layers for a given rank without communicating."""
    global _info, _tp_group, _tp_peers, _pp_group, _groups
    _info, _tp_group, _tp_peers, _pp_group = info, None, _peers_of(info), None
    _groups = _named_groups(info, {})


def init_distributed(info: ParallelInfo, rendezvous: Rendezvous, backend: str, timeout_s: float,
                     store_listener: socket.socket | None = None) -> None:
    """Join the world and build the TP groups. Every rank must call this with the same rendezvous (each
    with its own bind address). Across machines rank 0 passes the socket its store is to serve on
    (rendezvous.store_listener), which the store takes over; see rendezvous.py for what listens where."""
    global _info, _tp_group, _tp_peers, _pp_group, _groups
    _info, _tp_peers = info, _peers_of(info)
    if info.world_size == 1:
        _tp_group = _pp_group = None
        _groups = _named_groups(info, {})
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    bind_backends(rendezvous)
    if rendezvous.local:
        dist.init_process_group(backend=backend, init_method=rendezvous.init_method, rank=info.rank,
                                world_size=info.world_size, timeout=timeout)
    else:
        store = tcp_store(rendezvous, info.rank, info.world_size, timeout, store_listener)
        dist.init_process_group(backend=backend, store=store, rank=info.rank, world_size=info.world_size,
                                timeout=timeout)
    # new_group is collective over the whole world: every rank creates every group, in the same order.
    made: dict[str, object] = {}

    def new_groups(kind: str, members: list[list[int]], mine: int):
        """One group of `kind` per list of ranks (none for a single rank); this rank's is the `mine`-th."""
        for i, ranks in enumerate(members):
            group = dist.new_group(ranks, timeout=timeout, backend=backend, group_desc=f"{kind}{i}") \
                if len(ranks) > 1 else None
            if i == mine:
                made[kind] = group
        return made[kind]

    _tp_group = new_groups("tp", [[info.rank_of(t, pp) for t in range(info.tp_size)] for pp in range(info.pp_size)],
                           info.pp_rank)
    # The PP sends and receives go over a group of their own per TP rank (as Flight Recorder expects of p2p:
    # the ranks of a group are the ones that pair up).
    _pp_group = new_groups("pp", [[info.rank_of(t, pp) for pp in range(info.pp_size)] for t in range(info.tp_size)],
                           info.tp_rank)
    _groups = _named_groups(info, made)


def _named_groups(info: ParallelInfo, made: dict) -> tuple[GroupInfo, ...]:
    """(world, TP group, PP group) of this rank; torch's own names where the groups exist, else the ones torch would
    give them (the world is "0"; new groups count up from 1 in the order they are made: TP then PP)."""
    def named(kind: str, number: int, desc: str, ranks: list[int]) -> GroupInfo:
        g = made.get(kind)
        if g is not None:
            return GroupInfo(g.group_name, g.group_desc, tuple(dist.get_process_group_ranks(g)))
        return GroupInfo(str(number), desc, tuple(ranks))
    tp_made = info.pp_size if info.tp_size > 1 else 0
    return (GroupInfo("0", "default_pg", tuple(range(info.world_size))),
            named("tp", 1 + info.pp_rank, f"tp{info.pp_rank}",
                  [info.rank_of(t, info.pp_rank) for t in range(info.tp_size)]),
            named("pp", 1 + tp_made + info.tp_rank, f"pp{info.tp_rank}",
                  [info.rank_of(info.tp_rank, p) for p in range(info.pp_size)]))


def groups() -> tuple[GroupInfo, ...]:
    """This rank's (world, TP group, PP group)."""
    return _groups


def destroy_distributed() -> None:
    global _tp_group, _pp_group
    _tp_group = _pp_group = None
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _peers_of(info: ParallelInfo) -> list[int]:
    """The other ranks of this rank's TP group."""
    return [info.rank_of(t, info.pp_rank) for t in range(info.tp_size) if t != info.tp_rank]
