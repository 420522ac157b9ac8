"""Activation capture for layer-by-layer comparison (`devharness check`).

Armed on a worker, a model hook keeps the residual stream after each of this worker's decoder layers
for the next step, for the driver to fetch and compare with a tp=1, pp=1 run of the same prompt.
"""
from __future__ import annotations

import torch

from devharness.model import hooks
from devharness.model.hooks import ModelHooks


class _Capture(ModelHooks):
    def __init__(self) -> None:
        self.layers: dict[int, torch.Tensor] = {}

    def layer_end(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        stream = hidden if residual is None else hidden + residual
        self.layers[layer] = stream.detach().float().cpu().clone()


_capture = _Capture()


def arm() -> None:
    """Keep every layer's residual stream from now until take()."""
    _capture.layers.clear()
    hooks.install(_capture)


def take() -> dict[int, tuple[list[int], bytes]]:
    """The captured layers as (shape, float32 bytes), and disarm."""
    hooks.remove(_capture)
    out = {i: (list(t.shape), t.numpy().tobytes()) for i, t in _capture.layers.items()}
    _capture.layers.clear()
    return out
