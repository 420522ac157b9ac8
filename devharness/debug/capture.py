"""Activation capture for site-by-site comparison (`devharness check`).

Armed on a worker, model hooks keep, for every forward until taken, each of this worker's decoder layers'
attention output and MLP output (after their TP all-reduce) and the residual stream after the layer. At
tp > 1 a rank also keeps its own partial sums (its o_proj / down_proj share before the all-reduce); a tp=1
worker armed with `split` computes the partial sums each of `split` TP shards would produce from its
slice of heads / intermediate columns, so the driver can name the rank whose contribution parts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from devharness.distributed.parallel_state import get_parallel_info
from devharness.protocol.messages import CapturedTensor
from devharness.model import hooks
from devharness.model.hooks import ModelHooks


class _Capture(ModelHooks):
    def __init__(self) -> None:
        self.kept: list[tuple[int, int, str, int | None, torch.Tensor]] = []
        self.step = 0
        self.layer = 0
        self.own_shard: int | None = None   # at tp > 1: this rank's TP rank, whose partial sums it keeps
        self.split: int | None = None       # at tp = 1: how many shards' partial sums to compute

    def _keep(self, site: str, t: torch.Tensor, shard: int | None = None) -> None:
        self.kept.append((self.step, self.layer, site, shard, t.detach().float().cpu().clone()))

    def layer_start(self, layer: int) -> None:
        self.layer = layer

    def partial_sum(self, site: str, x: torch.Tensor, weight: torch.Tensor, partial: torch.Tensor) -> None:
        if self.own_shard is not None:
            self._keep(site, partial, self.own_shard)
        if self.split is None:
            return
        # RowParallelLinear gives TP rank r the r-th contiguous slice of the input columns.
        cols = x.shape[-1] // self.split
        for shard in range(self.split):
            part = slice(shard * cols, (shard + 1) * cols)
            self._keep(site, F.linear(x[..., part], weight[:, part]), shard)

    def sublayer_output(self, site: str, output: torch.Tensor) -> None:
        self._keep(site, output)

    def layer_end(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        self._keep("residual", hidden if residual is None else hidden + residual)

    def layers_done(self) -> None:
        self.step += 1


_capture = _Capture()


def arm(split: int | None = None) -> None:
    """Keep every site of every forward from now until take(); see the module docstring for `split`."""
    info = get_parallel_info()
    _capture.kept.clear()
    _capture.step = 0
    _capture.own_shard = info.tp_rank if info.tp_size > 1 else None
    _capture.split = split if info.tp_size == 1 and split is not None and split > 1 else None
    hooks.install(_capture)


def take() -> list[CapturedTensor]:
    """What was captured since arm(), and disarm."""
    hooks.remove(_capture)
    out = [CapturedTensor(step, layer, site, shard, list(t.shape), t.numpy().tobytes())
           for step, layer, site, shard, t in _capture.kept]
    _capture.kept.clear()
    return out
