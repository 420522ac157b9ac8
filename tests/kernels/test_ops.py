"""Every op of the kernel registry (devharness.kernels.OPS): the fast backend's implementation gives the op's
reference answer, within the tolerance OPS states for the op, bit for bit where that is rtol = atol = 0, over edge
inputs: the remainders of every tile and block size of the C kernels (rows in tiles of 12 (6 with 8-wide vectors)
then 8, 4, 2, 1; output columns in panels of 16 (8), in pairs and an odd one; vectors of 16 (8) lanes and a scalar
tail; cache blocks), one row, a context of one token, a block boundary, NaN and infinities in the inputs. Each case
runs on 1 and on 2 torch threads (the C kernels take torch's count) and with the kernels built for this machine's
vector width and for the other one.

Outputs are compared with NaN equal to NaN (the non-finite values must sit in the same places, infinities with
their signs), and so are the inputs after the call (an op may write only what it says it writes: write_kv's
caches, bit for bit; decode_attention's, its rotated keys within rotate's tolerance). linear_argmax is bit for bit the argmax of its own packed product (the fast linear's), and gives the
reference's token wherever the two logits are not within linear's tolerance of each other.

CASES holds every op's cases by name: an op added to OPS without cases fails here. An op whose fast form is its
reference (custom=False) runs its cases all the same. A case the two implementations do not agree on today is in
KNOWN with what is wrong (a strict xfail: it fails the run once it passes, so that the entry goes)."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from devharness.kernels import OPS, reference
from tests.kernels.conftest import DECODE_CASES, set_threads
from tests.kernels.quant_cases import q_embedding_cases, q_linear_argmax_cases, q_linear_cases

NAN, INF = float("nan"), float("inf")

# The C kernels' shapes (native.c): rows in tiles of MR = 12 (AVX-512) or 6, then 8, 4, 2, 1; output columns in
# panels of 16 or 8, taken in pairs and then an odd one; vectors of 16 or 8 lanes and then a scalar tail.
ROWS = (1, 2, 3, 5, 8, 11, 12, 13, 25)         # every tile and remainder at MR = 12 and at MR = 6
COLS = (1, 8, 9, 16, 17, 33, 48)               # panels whole and partial, one, a pair, a pair and an odd one
KS = (1, 3, 64, 576)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, scale: float = 1.0):
    return torch.randn(*shape, generator=g) * scale


def _weight(g, n, k):
    """A model-scale weight (the products of unit-scale inputs stay near 1, the scale OPS' tolerances are for)."""
    return _randn(g, n, k, scale=max(k, 1) ** -0.5)


# -- the cases: op name -> {case id: a builder of the op's arguments}. A builder is called once for each
# -- implementation and gives equal, independent tensors each time (its own seeded generator).

def _linear_cases():
    cases: dict[str, Callable] = {}
    for i, rows in enumerate(ROWS):
        for j, cols in enumerate(COLS):
            k = KS[(i + j) % len(KS)]
            cases[f"{rows} rows x {cols} columns, K {k}"] = \
                lambda rows=rows, cols=cols, k=k: (_randn(_gen(rows * 100 + cols), rows, k),
                                                   _weight(_gen(cols + 7), cols, k))

    def nonfinite_x():
        x, w = _randn(_gen(1), 5, 24), _weight(_gen(2), 40, 24)
        x[0, 3] = NAN                                   # row 0: NaN everywhere
        x[1, 5] = INF                                   # row 1: +-inf by the sign of each weight
        x[2, 0], x[2, 7] = INF, -INF                    # row 2: inf - inf
        return x, w

    def nonfinite_w():
        x, w = _randn(_gen(3), 13, 24), _weight(_gen(4), 33, 24)
        w[3, 2], w[20, 5], w[32, 0] = INF, -INF, NAN    # three columns: inf, -inf, NaN (and the last panel's)
        x[4, 2] = 0.0                                   # row 4: 0 * inf in column 3
        return x, w

    def biased(nonfinite: bool):
        def build():
            g = _gen(5)
            x, w, b = _randn(g, 5, 33), _weight(g, 17, 33), _randn(g, 17)
            if nonfinite:
                b[0], b[8], b[16] = INF, -INF, NAN
            return x, w, b
        return build

    cases.update({
        "a prefill chunk: 300 rows x 100 columns": lambda: (_randn(_gen(6), 300, 64), _weight(_gen(7), 100, 64)),
        "an LM head's width: 3 rows x 1000 columns (panel pairs on both threads)":
            lambda: (_randn(_gen(8), 3, 64), _weight(_gen(9), 1000, 64)),
        "a bias": biased(False),
        "a bias with inf, -inf and NaN": biased(True),
        "NaN and infinities in x": nonfinite_x,
        "NaN and infinities in the weight": nonfinite_w,
        "no rows": lambda: (torch.empty(0, 8), _weight(_gen(10), 16, 8)),
        "no features (K = 0)": lambda: (torch.empty(4, 0), torch.empty(48, 0)),
        "float64 (the reference's)": lambda: (_randn(_gen(11), 5, 24).double(), _weight(_gen(12), 17, 24).double()),
        "x not contiguous": lambda: (_randn(_gen(13), 24, 5).t(), _weight(_gen(14), 17, 24)),
        "the weight not contiguous": lambda: (_randn(_gen(15), 5, 24), _weight(_gen(16), 24, 17).t()),
    })
    return cases


INTERS = (8, 12, 16, 32, 48)   # gate/up halves of whole panels at 8 and at 16 lanes, or not (8 at 16, 12)


def _gated_linear_cases():
    cases: dict[str, Callable] = {}
    for i, rows in enumerate(ROWS):
        for j, inter in enumerate(INTERS):
            k = (1, 33, 64)[(i + j) % 3]
            cases[f"{rows} rows x {inter} x 2 columns, K {k}"] = \
                lambda rows=rows, inter=inter, k=k: (_randn(_gen(rows * 100 + inter), rows, k),
                                                     _weight(_gen(inter + 3), 2 * inter, k))

    def nonfinite_x(infinities: bool):
        def build():
            x, w = _randn(_gen(20), 5, 24), _weight(_gen(21), 2 * 32, 24)
            x[0, 3] = NAN
            if infinities:
                x[1, 5], x[1, 6] = INF, -INF              # gate and up products of +-inf and NaN
            return x, w
        return build

    def infinite_gate():
        """Gate products of +inf (and -inf) with finite up products: SiLU(inf) = inf, SiLU(-inf) = NaN."""
        x, w = _randn(_gen(22), 3, 24).abs() + 0.5, _weight(_gen(23), 2 * 16, 24)
        w[0, 0], w[1, 0] = INF, -INF                    # gate columns 0 and 1, up columns finite
        return x, w

    def very_negative_gate():
        """A gate product of about -1e36: SiLU of it is -0 (its exp overflows), not a number of x's size."""
        x, w = _randn(_gen(24), 3, 24).abs() + 0.5, _weight(_gen(25), 2 * 16, 24)
        w[0, 0] = -1e36
        return x, w

    cases.update({
        "an MLP: 13 rows x 1536 x 2 columns, K 576": lambda: (_randn(_gen(26), 13, 576),
                                                             _weight(_gen(27), 2 * 1536, 576)),
        "a bias": lambda: (_randn(_gen(28), 4, 8), _weight(_gen(29), 2 * 16, 8), _randn(_gen(30), 2 * 16)),
        "NaN in x": nonfinite_x(False),
        "NaN and infinities in x": nonfinite_x(True),
        "an infinite gate": infinite_gate,
        "a very negative gate": very_negative_gate,
        "no rows": lambda: (torch.empty(0, 8), _weight(_gen(31), 2 * 16, 8)),
        "float64 (the reference's)": lambda: (_randn(_gen(32), 4, 8).double(), _weight(_gen(33), 2 * 16, 8).double()),
        "x not contiguous": lambda: (_randn(_gen(34), 8, 4).t(), _weight(_gen(35), 2 * 16, 8)),
    })
    return cases


def _linear_argmax_cases():
    cases: dict[str, Callable] = {}
    shapes = ((1, 8, 1), (17, 24, 17), (40, 64, 37), (100, 33, 100), (1000, 64, 997))   # (N, K, num_valid)
    for rows in (1, 2, 5, 12, 13, 25):
        for n, k, valid in shapes:
            cases[f"{rows} rows x {n} columns ({valid} valid), K {k}"] = \
                lambda rows=rows, n=n, k=k, valid=valid: (_randn(_gen(rows * 10 + n), rows, k),
                                                          _weight(_gen(n + k), n, k), valid)

    def tied():
        x, w = _randn(_gen(40), 13, 64), _weight(_gen(41), 100, 64)
        w[97] = w[33] = 4 * x[0] / x[0].norm()          # row 0's largest logit, in two columns
        return x, w, 100

    def nan_columns():
        x, w = _randn(_gen(42), 13, 64), _weight(_gen(43), 100, 64)
        w[98] = w[50] = NAN                              # NaN ranks above every number: the first NaN column
        return x, w, 100

    def odd_rows():
        x, w = _randn(_gen(44), 13, 64), _weight(_gen(45), 1000, 64)
        x[-1] = NAN                                      # a row of NaN logits
        x[1] = 0.0
        x[1, 0] = INF                                    # every logit of row 1 is +-inf (or NaN)
        return x, w, 997

    def largest_past_valid():
        x, w = _randn(_gen(46), 5, 64), _weight(_gen(47), 40, 64)
        w[38] = 10 * x.mean(0) / x.mean(0).norm()       # the largest logits sit in a column past num_valid
        return x, w, 37

    cases.update({
        "an LM head: 13 rows x 3000 columns, K 576": lambda: (_randn(_gen(48), 13, 576), _weight(_gen(49), 3000, 576),
                                                              3000),
        "equal logits in two columns": tied,
        "NaN columns": nan_columns,
        "a NaN row and a row of infinite logits": odd_rows,
        "the largest logit past num_valid": largest_past_valid,
        "num_valid 1": lambda: (_randn(_gen(50), 5, 24), _weight(_gen(51), 17, 24), 1),
        "no rows": lambda: (torch.empty(0, 24), _weight(_gen(52), 17, 24), 17),
        "float64 (the reference's)": lambda: (_randn(_gen(53), 5, 24).double(), _weight(_gen(54), 17, 24).double(), 17),
    })
    return cases


def _argmax_rows(width: int) -> torch.Tensor:
    g = _gen(11)
    x = _randn(g, 12, width)
    x[0, 0] = x[0, width // 2] = x[0].max() + 1       # a tie: the first index
    x[1, width // 3] = x[1, width - 1] = NAN           # NaN ranks above every number: the first NaN
    x[2, width - 1] = NAN                              # a NaN in the last (tail) column
    x[3] = 0.0                                         # all equal: index 0
    x[4] = -INF
    x[5] = 1.0
    x[5, width - 1] = 2.0                              # the maximum in the last column
    x[6, width // 2] = INF
    x[7, :] = -INF
    x[7, width - 1] = NAN
    x[8, 0] = INF
    x[8, width - 1] = INF                              # equal infinities: the first
    return x


def _argmax_cases():
    cases: dict[str, Callable] = {f"12 rows of {w} (ties, NaN, infinities)": lambda w=w: (_argmax_rows(w),)
                                  for w in (1, 2, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 49157)}

    def signed_zeros():
        x = torch.zeros(2, 40)
        x[0, 0], x[0, 20] = -0.0, 0.0
        x[1] = -0.0
        x[1, 39] = 0.0
        return (x,)

    cases.update({
        "one row": lambda: (_randn(_gen(60), 1, 49157),),
        "a vocabulary of rows (2 threads)": lambda: (_randn(_gen(61), 64, 2048),),
        "-0.0 and 0.0 tie": signed_zeros,
        "no rows": lambda: (torch.empty(0, 5),),
        "float64 (the reference's)": lambda: (_argmax_rows(33).double(),),
        "not contiguous": lambda: (_argmax_rows(33).t().contiguous().t(),),
    })
    return cases


NORM_SHAPES = ((1, 1), (1, 15), (1, 16), (1, 17), (1, 576), (3, 33), (32, 576), (300, 64), (5, 3, 16))


def _norm_inputs(shape, seed, scale):
    g = _gen(seed)
    return _randn(g, *shape, scale=scale), _randn(g, *shape, scale=scale), 1.0 + _randn(g, shape[-1], scale=0.1)


def _nonfinite_rows(x):
    x[0, 0] = NAN
    x[1, -1] = INF
    x[2, 1] = -INF
    x[3] = 0.0
    return x


def _rms_norm_cases():
    cases: dict[str, Callable] = {}
    for shape in NORM_SHAPES:
        for scale in (1.0, 3e-3):   # small values: eps is a good part of the mean square
            cases[f"{shape}, values ~{scale}"] = \
                lambda shape=shape, scale=scale: (*_norm_inputs(shape, sum(shape), scale)[::2], 1e-5)

    def nonfinite():
        x, _, w = _norm_inputs((4, 40), 70, 1.0)
        return _nonfinite_rows(x), w, 1e-6

    def inf_weight():
        x, _, w = _norm_inputs((3, 40), 71, 1.0)
        w[5], w[17] = INF, NAN
        return x, w, 1e-5

    cases.update({
        "NaN, inf, -inf and a row of zeros in x": nonfinite,
        "inf and NaN in the weight": inf_weight,
        "values whose squares overflow": lambda: (_norm_inputs((3, 40), 72, 1e20)[0], _norm_inputs((3, 40), 72, 1.0)[2],
                                                  1e-5),
        "float64 (the reference's)": lambda: tuple(t.double() for t in _norm_inputs((3, 40), 73, 1.0)[::2]) + (1e-5,),
        "x not contiguous": lambda: (_randn(_gen(74), 40, 3).t(), _norm_inputs((3, 40), 74, 1.0)[2], 1e-5),
    })
    return cases


def _add_rms_norm_cases():
    cases: dict[str, Callable] = {}
    for shape in NORM_SHAPES:
        for scale in (1.0, 3e-3):
            cases[f"{shape}, values ~{scale}"] = lambda shape=shape, scale=scale: (*_norm_inputs(shape, sum(shape),
                                                                                                 scale), 1e-5)

    def nonfinite(where: str):
        def build():
            x, r, w = _norm_inputs((4, 40), 80, 1.0)
            if where == "x":
                _nonfinite_rows(x)
            elif where == "residual":
                _nonfinite_rows(r)
            else:
                x[0, 0], r[0, 0] = INF, -INF           # inf - inf in the sum
                x[1, 1], r[1, 1] = INF, INF
            return x, r, w, 1e-5
        return build

    cases.update({
        "NaN, infinities and a row of zeros in x": nonfinite("x"),
        "NaN, infinities and a row of zeros in the residual": nonfinite("residual"),
        "inf + -inf": nonfinite("both"),
        "a residual of one row, broadcast": lambda: (*_norm_inputs((3, 40), 81, 1.0)[::2][:1],
                                                     _randn(_gen(82), 1, 40), _norm_inputs((3, 40), 81, 1.0)[2], 1e-5),
        "float64 (the reference's)": lambda: tuple(t.double() for t in _norm_inputs((3, 40), 83, 1.0)) + (1e-5,),
        "x not contiguous": lambda: (_randn(_gen(84), 40, 3).t(), *_norm_inputs((3, 40), 84, 1.0)[1:], 1e-5),
    })
    return cases


def _rope_tables(positions, d):
    from devharness.model.layers import RotaryEmbedding
    return RotaryEmbedding(d, 1024, 10000.0, None)._tables(torch.tensor(positions), torch.float32)


def _rotate_cases():
    cases: dict[str, Callable] = {}
    for t, h, d in ((1, 1, 2), (1, 4, 64), (7, 4, 64), (7, 2, 128), (3, 9, 80), (2, 3, 16), (300, 2, 64)):
        positions = [(p * 37) % 1024 for p in range(t)]
        cases[f"{t} tokens x {h} heads x {d}"] = \
            lambda t=t, h=h, d=d, positions=positions: (_randn(_gen(t * h + d), t, h, d), *_rope_tables(positions, d))

    def strided(first: bool):
        def build():
            t, hq, hkv, d = 7, 4, 2, 64
            qkv = _randn(_gen(90), t, (hq + 2 * hkv) * d)
            x = qkv[:, :hq * d].view(t, hq, d) if first else qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
            return x, *_rope_tables([0, 3, 5, 100, 101, 200, 511], d)
        return build

    def nonfinite():
        x = _randn(_gen(91), 3, 2, 16)
        x[0, 0, 0], x[1, 1, 9], x[2, 0, 3] = NAN, INF, -INF
        return x, *_rope_tables([0, 1, 700], 16)        # position 0: sin 0, so inf * 0

    cases.update({
        "q, a strided view of qkv": strided(True),
        "k, a strided view of qkv": strided(False),
        "NaN and infinities in x": nonfinite,
        "an odd head size (the reference's)": lambda: (_randn(_gen(92), 2, 2, 5), _randn(_gen(93), 2, 1, 5),
                                                       _randn(_gen(94), 2, 1, 5)),
        "float64 (the reference's)": lambda: tuple(t.double() for t in (_randn(_gen(95), 3, 2, 16),
                                                                         *_rope_tables([1, 2, 3], 16))),
        "heads not contiguous (the reference's)": lambda: (_randn(_gen(96), 2, 3, 16).transpose(0, 1),
                                                           *_rope_tables([4, 5, 6], 16)),
    })
    return cases


def _silu_and_mul_cases():
    cases: dict[str, Callable] = {}
    for t, i in ((1, 1), (1, 8), (1, 15), (1, 16), (1, 17), (3, 33), (2, 13), (64, 1536)):
        cases[f"{t} rows x {i} x 2"] = lambda t=t, i=i: (_randn(_gen(t * 1000 + i), t, 2 * i, scale=30.0),)

    def exp_range():
        """The exp's range: SiLU is neither 0 nor x for gates of magnitude up to ~90."""
        gu = _randn(_gen(100), 2, 2 * 47)                  # 47 gates: a tail of 15 (16 lanes) or 7 (8 lanes)
        values = torch.tensor([-89.0, -87.5, -87.0, -86.9, 88.0, 88.5, 89.0, 0.0, -0.0, -20.0, 20.0, 1e-30,
                               -103.0, -104.0, 100.0, -100.0])
        gu[0, :16] = values                               # in the vectors
        gu[1, 31:47] = values                             # mostly in the tail
        return (gu,)

    def nonfinite(part: str, values: list[float]):
        def build():
            gu = _randn(_gen(101), 2, 2 * 47)              # 47 gates: a tail of 15 (16 lanes) or 7 (8 lanes)
            v = torch.tensor(values)
            if part == "gate, vectors":
                gu[0, :len(v)] = v
            elif part == "gate, tail":
                gu[0, 47 - len(v):47] = v
            else:                                         # up
                gu[0, 47:47 + len(v)] = v
            return (gu,)
        return build

    cases.update({
        "the exp's range": exp_range,
        "NaN and -inf gates in the vectors": nonfinite("gate, vectors", [NAN, -INF, NAN, -INF]),
        "+inf gates in the vectors": nonfinite("gate, vectors", [INF, 1.0, INF, 2.0]),
        "NaN and infinite gates in the tail": nonfinite("gate, tail", [NAN, INF, -INF]),
        "NaN and infinities in up": nonfinite("up", [NAN, INF, -INF, 0.0]),
        "very negative gates": nonfinite("gate, vectors", [-1e36, -3e38, -1e30, -1e20]),
        "float64 (the reference's)": lambda: (_randn(_gen(102), 3, 2 * 20).double(),),
        "not contiguous (the reference's)": lambda: (_randn(_gen(103), 2 * 20, 3).t(),),
    })
    return cases


def _kv(seed, t, num_blocks=6, block_size=4, hkv=3, d=16, strided_v=True):
    g = _gen(seed)
    k_cache, v_cache = _randn(g, num_blocks, block_size, hkv, d), _randn(g, num_blocks, block_size, hkv, d)
    k = _randn(g, t, hkv, d)
    v = _randn(g, t, 3 * hkv * d)[:, 2 * hkv * d:].view(t, hkv, d) if strided_v else _randn(g, t, hkv, d)
    return k_cache, v_cache, k, v


def _write_kv_cases():
    def case(seed, slots, **kw):
        def build():
            k_cache, v_cache, k, v = _kv(seed, len(slots), **kw)
            return k_cache, v_cache, torch.tensor(slots, dtype=torch.int64), k, v
        return build

    def nonfinite():
        k_cache, v_cache, slots, k, v = case(110, [0, 5, 23])()
        k[0, 0, 0], k[1, 2, 15], v[2, 1, 3], v[0, 0, 1] = NAN, INF, -INF, NAN
        return k_cache, v_cache, slots, k, v

    def int32_slots():
        k_cache, v_cache, slots, k, v = case(111, [0, 5, 23])()
        return k_cache, v_cache, slots.int(), k, v

    def heads_apart():
        k_cache, v_cache, slots, k, v = case(112, [1, 2, 3])()
        return k_cache, v_cache, slots, k.transpose(1, 2).contiguous().transpose(1, 2), v

    return {
        "one token, slot 0": case(113, [0]),
        "one token, the last slot": case(114, [23]),
        "a block boundary (slots 3, 4)": case(115, [3, 4]),
        "5 tokens, v a strided view": case(116, [0, 5, 23, 9, 12]),
        "blocks of 16, heads of 64": case(117, [15, 16, 17, 63], num_blocks=4, block_size=16, hkv=2, d=64,
                                          strided_v=False),
        "no tokens": case(118, []),
        "NaN and infinities in k and v": nonfinite,
        "int32 slots (the reference's: an error)": int32_slots,
        "k's heads not contiguous (the reference's)": heads_apart,
        "float64 (the reference's)": lambda: tuple(t.double() if t.is_floating_point() else t
                                                   for t in case(119, [1, 7])()),
    }


def _decode(seed, hq, hkv, d, block_size, lens, q_scale=1.0, num_blocks=64):
    g = _gen(seed)
    k_cache = _randn(g, num_blocks, block_size, hkv, d)
    v_cache = _randn(g, num_blocks, block_size, hkv, d)
    width = max(-(-n // block_size) for n in lens) + 1     # one padding column past the longest row
    tables = torch.randint(0, num_blocks, (len(lens), width), generator=g)
    q = _randn(g, len(lens), hq, d, scale=q_scale)
    return q, k_cache, v_cache, tables, torch.tensor(lens), d ** -0.5


DECODE_SHAPES = DECODE_CASES


def _paged_decode_cases():
    cases: dict[str, Callable] = {}
    for hq, hkv, d, bs, lens, q_scale in DECODE_SHAPES:
        cases[f"{hq}/{hkv} heads of {d}, blocks of {bs}, contexts {lens}, q x{q_scale}"] = \
            lambda hq=hq, hkv=hkv, d=d, bs=bs, lens=lens, q_scale=q_scale: _decode(len(lens) + d + bs, hq, hkv, d, bs,
                                                                                  lens, q_scale)

    def changed(edit):
        def build():
            q, k_cache, v_cache, _, lens, scale = _decode(120, 4, 2, 64, 16, [20, 40])
            tables = torch.randperm(64, generator=_gen(122))[:8].view(2, 4)   # 8 blocks, no two alike
            edit(q, k_cache, v_cache, tables)
            return q, k_cache, v_cache, tables, lens, scale
        return build

    def nan_query(q, k_cache, v_cache, tables):
        q[0, 1, 5] = NAN                                   # row 0, head 1

    def inf_value(q, k_cache, v_cache, tables):
        v_cache[tables[1, 0], 3, 0, 7] = INF                # row 1's token 3, KV head 0

    def neg_inf_key(q, k_cache, v_cache, tables):
        k_cache[tables[1, 0], 2, 1] = 0.0                    # row 1's token 2, KV head 1: a score of -inf
        k_cache[tables[1, 0], 2, 1, 0] = -INF * torch.sign(q[1, 2, 0]).item() or -INF

    def pos_inf_key(q, k_cache, v_cache, tables):
        k_cache[tables[0, 1], 1, 0] = 0.0                    # row 0's token 17, KV head 0: a score of +inf
        k_cache[tables[0, 1], 1, 0, 0] = INF * torch.sign(q[0, 0, 0]).item() or INF

    def nan_past_context(q, k_cache, v_cache, tables):
        k_cache[tables[0, 1], 5] = NAN                       # row 0's position 21: past its 20
        v_cache[tables[0, 1], 5] = NAN

    def nan_padding_block(q, k_cache, v_cache, tables):
        k_cache[tables[0, 2]] = NAN                          # row 0's table padding (its context: 2 blocks)
        v_cache[tables[0, 2]] = NAN

    cases.update({
        "NaN in a query head": changed(nan_query),
        "inf in a value": changed(inf_value),
        "a key that scores -inf": changed(neg_inf_key),
        "a key that scores +inf": changed(pos_inf_key),
        "NaN in the cache past a context": changed(nan_past_context),
        "NaN in a padding block of a table": changed(nan_padding_block),
        "float64 (the reference's)": lambda: tuple(t.double() if torch.is_tensor(t) and t.is_floating_point() else t
                                                   for t in _decode(121, 4, 2, 64, 16, [5, 20])),
    })
    return cases


def _decode_step(seed, hq, hkv, d, block_size, lens, q_scale=1.0, strided=True):
    """decode_attention's arguments: a row per context, its token the context's last (at its slot in the row's own
    blocks, no two rows alike), q, k and v views of one qkv product (strided: as the model's split gives them)."""
    g = _gen(seed)
    width = max(-(-n // block_size) for n in lens) + 1     # one padding column past the longest row
    num_blocks = max(64, len(lens) * width)
    k_cache = _randn(g, num_blocks, block_size, hkv, d)
    v_cache = _randn(g, num_blocks, block_size, hkv, d)
    tables = torch.randperm(num_blocks, generator=g)[:len(lens) * width].view(len(lens), width)
    slots = torch.tensor([int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for b, n in enumerate(lens)])
    qkv = _randn(g, len(lens), (hq + 2 * hkv) * d)
    qkv[:, :hq * d] *= q_scale
    q, k, v = (x.view(len(lens), -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    if not strided:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cos, sin = _rope_tables([n - 1 for n in lens], d)
    return q, k, v, cos, sin, k_cache, v_cache, slots, tables, torch.tensor(lens), d ** -0.5


def _decode_attention_cases():
    cases: dict[str, Callable] = {}
    for hq, hkv, d, bs, lens, q_scale in DECODE_SHAPES:
        cases[f"{hq}/{hkv} heads of {d}, blocks of {bs}, contexts {lens}, q x{q_scale}"] = \
            lambda hq=hq, hkv=hkv, d=d, bs=bs, lens=lens, q_scale=q_scale: _decode_step(len(lens) + d + bs, hq, hkv,
                                                                                       d, bs, lens, q_scale)

    def edited(edit, lens=(20, 33)):
        def build():
            args = list(_decode_step(140, 4, 2, 64, 16, list(lens)))
            edit(args)
            return tuple(args)
        return build

    def nan_query(args):
        args[0][0, 1, 5] = NAN                               # row 0, head 1

    def int32_slots(args):
        args[7] = args[7].int()

    cases.update({
        "one row, a context of one token": lambda: _decode_step(141, 9, 3, 64, 16, [1]),
        "one row, its token a block's first (context 17)": lambda: _decode_step(142, 9, 3, 64, 16, [17]),
        "one row, its token a block's last (context 16)": lambda: _decode_step(143, 9, 3, 64, 16, [16]),
        "q, k and v contiguous": lambda: _decode_step(144, 9, 3, 64, 16, [5, 40], strided=False),
        "NaN in a query head": edited(nan_query),
        "int32 slots (the reference's: an error)": edited(int32_slots),
        "float64 (the reference's)": lambda: tuple(t.double() if torch.is_tensor(t) and t.is_floating_point() else t
                                                   for t in _decode_step(145, 4, 2, 64, 16, [5, 20])),
        "heads not contiguous (the reference's)": edited(lambda args: args.__setitem__(
            0, args[0].transpose(1, 2).contiguous().transpose(1, 2))),
    })
    return cases


def _prefill(seed, hq, hkv, d, n, context_len, block_size=16, num_blocks=8):
    g = _gen(seed)
    q, k, v = _randn(g, n, hq, d), _randn(g, n, hkv, d), _randn(g, n, hkv, d)
    k_cache, v_cache = _randn(g, num_blocks, block_size, hkv, d), _randn(g, num_blocks, block_size, hkv, d)
    block_ids = torch.randperm(num_blocks, generator=g)[:-(-context_len // block_size)]
    return q, k, v, k_cache, v_cache, block_ids, context_len, d ** -0.5


def _prefill_attention_cases():
    """The custom kernel's edges: tiles of MR = 12 (query, head) rows of a KV head and what is left (8, 4, 2, 1;
    6 rows with 8-wide vectors), keys a pair of 16-token panels at a time (8 with 8-wide vectors) and a last
    partial one, the chunk's own keys or the cache's blocks, head sizes 32, 64 and 128, one KV head or one per
    query head; NaN and infinities; what it leaves to the reference."""
    def edited(build, edit):
        def make():
            args = list(build())
            edit(args)
            return tuple(args)
        return make

    def nan_query(args):
        args[0][2, 1, 0] = NAN

    def nan_key(args):   # cached position 19 (block 1, row 3), which every query of the chunk (34-39) sees
        args[3][args[5][1], 3, 1, 7] = NAN

    def inf_query(args):
        args[0][1, 0, 3], args[0][3, 2, 0] = INF, -INF

    def views_of_qkv(args):   # q, k and v as the model hands them: views of one projection's rows
        n, hq, d = args[0].shape
        hkv = args[1].shape[1]
        qkv = torch.cat([args[0], args[1], args[2]], dim=1).reshape(n, -1)
        args[0], args[1], args[2] = qkv.view(n, -1, d).split_with_sizes([hq, hkv, hkv], dim=1)

    def bad_block(args):
        args[5] = args[5].clone()
        args[5][1] = 99

    return {
        "a prompt of one token": lambda: _prefill(130, 4, 2, 64, 1, 1),
        "a prompt of 20 tokens, nothing cached": lambda: _prefill(131, 9, 3, 64, 20, 20),
        "a chunk of 5 after 27 cached (past a block boundary)": lambda: _prefill(132, 4, 2, 64, 5, 32),
        "a chunk of 1 after 16 cached": lambda: _prefill(133, 4, 4, 128, 1, 17),
        "a prompt of 70 tokens, 9 heads over 3 (whole tiles and the rest)": lambda: _prefill(135, 9, 3, 64, 70, 70),
        "a chunk of 23 after 50 cached, 5 heads over 1, head size 32":
            lambda: _prefill(136, 5, 1, 32, 23, 73, num_blocks=6),
        "a chunk of 7 after 121 cached, head size 128": lambda: _prefill(137, 2, 2, 128, 7, 128),
        "q, k and v views of the qkv product": edited(lambda: _prefill(138, 9, 3, 64, 29, 29), views_of_qkv),
        "NaN in a query": edited(lambda: _prefill(134, 4, 2, 64, 5, 5), nan_query),
        "NaN in a cached key": edited(lambda: _prefill(139, 4, 2, 64, 6, 40), nan_key),
        "infinities in the queries": edited(lambda: _prefill(140, 4, 2, 64, 6, 6), inf_query),
        "a block outside the cache (the reference's error)": edited(lambda: _prefill(141, 4, 2, 64, 3, 40),
                                                                     bad_block),
        "float64 (the reference's)": lambda: tuple(t.double() if torch.is_tensor(t) and t.is_floating_point() else t
                                                   for t in _prefill(142, 4, 2, 64, 5, 20)),
        "heads not contiguous (the reference's)": edited(lambda: _prefill(143, 4, 2, 64, 5, 5), lambda args:
                                                         args.__setitem__(0, args[0].transpose(1, 2).contiguous()
                                                                          .transpose(1, 2))),
    }


CASES: dict[str, dict[str, Callable]] = {
    "linear": _linear_cases(),
    "gated_linear": _gated_linear_cases(),
    "linear_argmax": _linear_argmax_cases(),
    "argmax": _argmax_cases(),
    "rms_norm": _rms_norm_cases(),
    "add_rms_norm": _add_rms_norm_cases(),
    "rotate": _rotate_cases(),
    "silu_and_mul": _silu_and_mul_cases(),
    "write_kv": _write_kv_cases(),
    "paged_decode": _paged_decode_cases(),
    "decode_attention": _decode_attention_cases(),
    "prefill_attention": _prefill_attention_cases(),
    "q_linear": q_linear_cases(),
    "q_gated_linear": q_linear_cases(gated=True),
    "q_linear_argmax": q_linear_argmax_cases(),
    "q_embedding": q_embedding_cases(),
}

# Cases where the two implementations do not agree today: (op, case) -> what is wrong. Strict: once fixed, the
# case passes, and the entry must go.
KNOWN: dict[tuple[str, str], str] = {}


# The arguments an op writes, within a tolerance where it writes what it computes: decode_attention writes the
# rotated keys (rotate's tolerance); every other argument bit for bit.
ARGUMENT_TOLERANCE = {"decode_attention": (OPS["rotate"].rtol, OPS["rotate"].atol)}


def test_every_op_has_cases():
    assert set(CASES) == set(OPS)
    assert all(CASES[name] for name in OPS)


def _params():
    for name in OPS:
        for case in CASES.get(name) or ["(no cases: add some to CASES)"]:
            marks = [pytest.mark.xfail(strict=True, reason=KNOWN[name, case])] if (name, case) in KNOWN else []
            yield pytest.param(name, case, id=f"{name}: {case}", marks=marks)


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    yield from set_threads(request.param)


@pytest.fixture(params=["this machine's vector width", "the other vector width"])
def width(request):
    if request.param == "the other vector width":
        request.getfixturevalue("other_vector_width")
    return request.param


def _same(got, want, rtol, atol, what):
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, rtol, atol, f"{what}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), what
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"{what}: {m}")
        if rtol == atol == 0 and want.is_floating_point():   # bit for bit: -0.0 is not 0.0, NaNs keep their bits
            bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
            assert torch.equal(got.view(bits), want.view(bits)), f"{what}: equal, but not bit for bit"
    else:
        assert got == want, what


def _check_linear_argmax(fast, got, want, args):
    """Bit for bit the argmax of the fast linear's own product; where it picks another column than the reference,
    the reference's logits at the two are within linear's tolerance of each other (a near tie)."""
    x, w, num_valid = args
    own = reference.argmax(fast.linear(x, w)[:, :num_valid])
    assert torch.equal(got, own), "not the argmax of its own product"
    assert got.shape == want.shape and got.dtype == want.dtype
    rows = (got != want).nonzero().flatten()
    if len(rows):
        logits = reference.linear(x, w)[:, :num_valid]
        torch.testing.assert_close(logits[rows, got[rows]], logits[rows, want[rows]], rtol=OPS["linear"].rtol,
                                   atol=OPS["linear"].atol, equal_nan=True,
                                   msg=lambda m: f"rows {rows.tolist()} pick columns that are no near tie: {m}")


def _check_q_linear_argmax(fast, got, want, args):
    """linear_argmax's check for the LM head in blocks: bit for bit the argmax of the fast q_linear's own product,
    and where it picks another column than the reference, a near tie of the reference's logits."""
    x, blocks, qtype, num_valid = args
    own = reference.argmax(fast.q_linear(x, blocks, qtype)[:, :num_valid])
    assert torch.equal(got, own), "not the argmax of its own product"
    assert got.shape == want.shape and got.dtype == want.dtype
    rows = (got != want).nonzero().flatten()
    if len(rows):
        logits = reference.q_linear(x, blocks, qtype)[:, :num_valid]
        torch.testing.assert_close(logits[rows, got[rows]], logits[rows, want[rows]], rtol=OPS["q_linear"].rtol,
                                   atol=OPS["q_linear"].atol, equal_nan=True,
                                   msg=lambda m: f"rows {rows.tolist()} pick columns that are no near tie: {m}")


def _call(fn, args):
    try:
        return fn(*args), None
    except Exception as e:   # the reference refuses the inputs: the fast op must refuse them alike
        return None, e


@pytest.mark.parametrize("name, case", _params())
def test_fast_agrees_with_the_reference(name, case, threads, width, fast):
    assert CASES.get(name), f"op {name!r} has no cases in tests/kernels/test_ops.py"
    op, build = OPS[name], CASES[name][case]
    want_args, got_args = build(), build()
    want, refused = _call(op.reference, want_args)
    got, failed = _call(getattr(fast, name), got_args)
    if refused is not None:
        assert type(failed) is type(refused), f"the reference raised {refused!r}, the fast op {failed!r}"
    elif failed is not None:
        raise failed
    elif name == "linear_argmax":
        _check_linear_argmax(fast, got, want, got_args)
    elif name == "q_linear_argmax":
        _check_q_linear_argmax(fast, got, want, got_args)
    else:
        _same(got, want, op.rtol, op.atol, f"{name} ({case})")
    rtol, atol = ARGUMENT_TOLERANCE.get(name, (0.0, 0.0))
    _same(got_args, want_args, rtol, atol, f"{name}'s arguments after the call ({case})")
