"""Activation capture for layer-by-layer comparison (`devharness check`).

Armed on a worker, it keeps the residual stream after each of this worker's decoder layers for
the next step, for the driver to fetch and compare with a tp=1, pp=1 run of the same prompt.
"""
from __future__ import annotations

import torch

# Off unless armed: the layer loop pays one attribute test per layer.
active = False
_layers: dict[int, torch.Tensor] = {}


def arm() -> None:
    global active
    _layers.clear()
    active = True


def record(layer: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
    stream = hidden if residual is None else hidden + residual
    _layers[layer] = stream.detach().float().cpu().clone()


def take() -> dict[int, tuple[list[int], bytes]]:
    """The captured layers as (shape, float32 bytes), and disarm."""
    global active
    active = False
    out = {i: (list(t.shape), t.numpy().tobytes()) for i, t in _layers.items()}
    _layers.clear()
    return out
