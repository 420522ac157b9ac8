"""The quantized ops' cases for tests/kernels/test_ops.py: weights quantized by the gguf package (gguf.quants, an
implementation independent of devharness's) into Q8_0 and Q4_1 blocks. Edge shapes for the C kernel's three forms
(native.c's q_linear_f32 and its repacks): below 4 rows of x, groups of QW = 4 weight rows (2 with 8-wide vectors)
against every row of x, a last partial group a row at a time; from 4 to the panel rows (8 gated, 16 not), tiles of
QMR = 8 rows (4 with 8-wide vectors) x 2 output columns, then 4, 2, 1 rows and a last column alone; from there,
the weights dequantized a panel pair (32 columns, 16 with 8-wide vectors) at a time from their panel repack and
tiles of MR = 12 rows (6), then 8, 4, 2, 1, the last pair partial (a gated product whose halves are not whole
panels: the same panels dequantized from the blocks, as every row count from 64 did before the repack). K one
block (32), a few, 18 and 48 blocks; output columns 1, odd, past a pair; NaN and infinities in the activations in
each form. Inputs the ops refuse: x's K not whole 32-weight blocks (100 columns against a 96-column weight), a
weight row whose bytes end inside a block; the fast op falls back to the reference there and refuses them alike."""
from __future__ import annotations

import functools
from typing import Callable

import gguf
import gguf.quants
import numpy as np
import torch

NAN, INF = float("nan"), float("inf")
QTYPES = {"Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1}


@functools.lru_cache(maxsize=None)
def _quantized(seed: int, n: int, k: int, qtype: str) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * k ** -0.5
    return np.ascontiguousarray(gguf.quants.quantize(w, QTYPES[qtype]))


def blocks(seed: int, n: int, k: int, qtype: str) -> torch.Tensor:
    """A fresh uint8 [n, k / 32 * block bytes] tensor of a random model-scale weight's blocks."""
    return torch.from_numpy(_quantized(seed, n, k, qtype).copy())


def _x(seed: int, rows: int, k: int) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))


# (rows of x, output rows, K): the shapes each quantized linear op runs at, for each of the two types.
SHAPES = ((1, 1, 32), (1, 37, 576), (2, 7, 160), (3, 17, 96), (3, 4, 32),   # below 4 rows: groups, the rest 1-3
          (5, 33, 64), (32, 9, 32), (13, 48, 576),
          (4, 1, 32), (7, 37, 1536), (8, 2, 64), (63, 33, 96),            # the row tiles: whole, 4 + 2 + 1, 7 x 8 + 7
          (64, 1, 32), (64, 17, 1536), (75, 48, 576), (131, 100, 64))      # the panels: one column, partial pairs


def _nonfinite(rows, k):
    x = _x(9, rows, k)
    x[0, 3] = NAN
    x[1, 40] = INF
    x[2, 0], x[2, 33] = INF, -INF
    return x


def q_linear_cases(gated: bool = False) -> dict[str, Callable]:
    cases: dict[str, Callable] = {}
    for name, qt in QTYPES.items():
        for rows, n, k in SHAPES:
            n2 = 2 * n if gated else n
            cases[f"{name}: {rows} rows x {n} outputs, K {k}"] = \
                lambda rows=rows, n2=n2, k=k, name=name, qt=qt: (_x(rows + n2 + k, rows, k),
                                                                 blocks(n2 + k, n2, k, name), int(qt))
        for rows in (5, 70):   # the row tiles and the panels
            cases[f"{name}: NaN and infinities in x, {rows} rows"] = \
                lambda name=name, qt=qt, rows=rows: (_nonfinite(rows, 64), blocks(3, 34 if gated else 17, 64, name),
                                                     int(qt))
        cases[f"{name}: with a bias"] = \
            lambda name=name, qt=qt: (_x(4, 3, 64), blocks(4, 34 if gated else 17, 64, name), int(qt),
                                      torch.randn(34 if gated else 17, generator=torch.Generator().manual_seed(5)))
        cases.update(_refused(name, qt, lambda x, b, qt: (x, b, qt), 2 if gated else 1))
    return cases


def _refused(name: str, qt, args: Callable, rows_per_output: int = 1) -> dict[str, Callable]:
    """The cases an op refuses (the reference raises; the fast op must raise the same exception type)."""
    n = 10 * rows_per_output
    return {f"{name}: K not whole blocks (x 100 columns, the weight 96)":
            lambda: args(_x(11, 3, 100), blocks(11, n, 96, name), int(qt)),
            f"{name}: a weight row ending inside a block":
            lambda: args(_x(12, 3, 64), blocks(12, n, 64, name)[:, :-1].contiguous(), int(qt))}


def q_linear_argmax_cases() -> dict[str, Callable]:
    cases: dict[str, Callable] = {}
    for name, qt in QTYPES.items():
        for rows, n, k, valid in ((1, 37, 576, 37), (5, 33, 64, 20), (32, 200, 96, 199), (70, 75, 64, 60)):
            cases[f"{name}: {rows} rows x {n} outputs ({valid} valid), K {k}"] = \
                lambda rows=rows, n=n, k=k, valid=valid, name=name, qt=qt: (_x(rows + k, rows, k),
                                                                            blocks(n + 1, n, k, name), int(qt), valid)
        for rows in (5, 70):
            cases[f"{name}: NaN in a row of x, {rows} rows"] = \
                lambda name=name, qt=qt, rows=rows: (_nonfinite(rows, 64), blocks(6, 40, 64, name), int(qt), 40)
        cases.update(_refused(name, qt, lambda x, b, qt: (x, b, qt, 7)))
    return cases


def q_embedding_cases() -> dict[str, Callable]:
    cases: dict[str, Callable] = {}
    for name, qt in QTYPES.items():
        cases[f"{name}: one id"] = lambda name=name, qt=qt: (torch.tensor([7]), blocks(7, 50, 96, name), int(qt))
        cases[f"{name}: repeated ids, first and last rows"] = \
            lambda name=name, qt=qt: (torch.tensor([49, 0, 3, 3, 49]), blocks(8, 50, 576, name), int(qt))
        cases[f"{name}: an id past the vocabulary"] = \
            lambda name=name, qt=qt: (torch.tensor([2, 50]), blocks(9, 50, 32, name), int(qt))
    return cases
