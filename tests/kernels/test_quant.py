"""The quantized ops' ground: reference.dequantize reads GGUF's Q8_0 and Q4_1 blocks as the gguf package does,
bit for bit (test_ops.py then holds the fast kernels to the reference), and the fast ops run the C kernel on the
tensors the model hands them rather than falling back to the reference."""
from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from devharness.kernels import cpu, reference
from tests.kernels.conftest import require_library
from tests.kernels.quant_cases import QTYPES, blocks

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", sorted(QTYPES))
def test_dequantize_is_ggufs(name):
    w = np.random.default_rng(1).standard_normal((9, 96)).astype(np.float32)
    w[0, :32] = 0.0                                    # an all-zero block: d = 0
    w[1, 32:64] = 1e-6                                 # a constant block of tiny values (subnormal fp16 scales)
    w[2, 64:] = 6e4                                    # near fp16's largest
    q = np.ascontiguousarray(gguf.quants.quantize(w, QTYPES[name]))
    want = torch.from_numpy(gguf.quants.dequantize(q, QTYPES[name]).copy())
    got = reference.dequantize(torch.from_numpy(q.copy()), int(QTYPES[name]))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_dequantize_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="ggml type 12"):
        reference.dequantize(torch.zeros(2, 144, dtype=torch.uint8), 12)   # Q4_K
    with pytest.raises(ValueError, match="whole 34-byte blocks"):
        reference.dequantize(torch.zeros(2, 33, dtype=torch.uint8), int(QTYPES["Q8_0"]))


@pytest.mark.parametrize("name", sorted(QTYPES))
def test_the_c_kernel_takes_the_models_tensors(name):
    require_library()
    x, b = torch.randn(3, 576), blocks(1, 40, 576, name)
    for rows in (3, 8, 70):   # each of its forms: a row at a time, tiles of rows, panels
        for gated in (False, True):
            y = cpu.q_linear(torch.randn(rows, 576), b, int(QTYPES[name]), gated=gated)
            assert y is not None and y.shape == (rows, 20 if gated else 40)
    assert cpu.q_linear(x[:, :100], b, int(QTYPES[name])) is None    # K not whole blocks: the reference's error
    assert cpu.q_linear(x.double(), b, int(QTYPES[name])) is None


@pytest.mark.parametrize("name", sorted(QTYPES))
@pytest.mark.parametrize("gated", [False, True], ids=["linear", "gated"])
def test_a_row_gets_the_same_bits_alone_as_beside_others(name, gated):
    """Below 4 rows of x (decode's), each row's outputs are summed in the same order whatever rows come with it:
    a request's tokens do not change with the batch it decodes in."""
    require_library()
    b = blocks(7, 2 * 23 if gated else 23, 192, name)   # 23 outputs: whole groups of weight rows and a partial one
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(8))
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            together = {rows: cpu.q_linear(x[:rows], b, int(QTYPES[name]), gated=gated) for rows in (1, 2, 3)}
            alone = torch.cat([cpu.q_linear(x[i:i + 1], b, int(QTYPES[name]), gated=gated) for i in range(3)])
        finally:
            torch.set_num_threads(before)
        for rows, y in together.items():
            assert torch.equal(y.view(torch.int32), alone[:rows].view(torch.int32)), f"{rows} rows, {threads} threads"


@pytest.mark.parametrize("name", sorted(QTYPES))
@pytest.mark.parametrize("outputs", [23, 24, 1])
@pytest.mark.parametrize("width", ["native", "other"])
def test_the_repack_gives_the_blocks_bits(name, outputs, width, request):
    """Below 4 rows of x the C kernel reads the weight's repack (scales as floats beside the payloads): the same
    bits as its kernel over GGUF's blocks, with NaN and infinities in x, for a partial last group of rows, gated or
    not, on 1 and 2 threads, at both vector widths (their groups of weight rows differ)."""
    require_library()
    if width == "other":
        request.getfixturevalue("other_vector_width")
    qtype = int(QTYPES[name])
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(3))
    x[1, 5], x[2, 40], x[2, 41] = float("nan"), float("inf"), -float("inf")
    for gated in (False, True):
        b = blocks(9, 2 * outputs if gated else outputs, 192, name)
        assert cpu.q_repacked(b, qtype, 192) is not None
        for threads in (1, 2):
            for rows in (1, 2, 3):
                xr = x[:rows].contiguous()
                want = torch.empty(rows, outputs)
                assert cpu._kernel.q_linear_f32(xr.data_ptr(), b.data_ptr(), want.data_ptr(), rows, outputs, 192,
                                                qtype, int(gated), threads) == 0
                before = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    got = cpu.q_linear(xr, b, qtype, gated=gated)
                finally:
                    torch.set_num_threads(before)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (gated, threads, rows)


@pytest.mark.parametrize("name", sorted(QTYPES))
@pytest.mark.parametrize("outputs", [48, 40, 1])
@pytest.mark.parametrize("width", ["native", "other"])
def test_the_panel_repack_gives_the_blocks_panels_bits(name, outputs, width, request):
    """From its panel rows the C kernel reads the weight's panel repack (scales as floats, payloads k-major): at 64 rows
    and more, the bits of its panels over GGUF's blocks (the same products in the same order), with NaN and
    infinities in x, a partial last panel or pair, gated or not, on 1 and 2 threads, at both vector widths (their
    panels differ), in one pass over the rows of x and in two; from the panel rows to 63 (where the blocks' kernel
    tiles instead) within the op's tolerance of the reference."""
    require_library()
    if width == "other":
        request.getfixturevalue("other_vector_width")
    qtype = int(QTYPES[name])
    x = torch.randn(140, 96, generator=torch.Generator().manual_seed(4))
    x[1, 5], x[2, 40], x[2, 41], x[135, 7] = float("nan"), float("inf"), -float("inf"), float("nan")
    panel = cpu._kernel.panel
    for gated in (False, True):
        if gated and outputs % panel:
            continue   # the up rows would not start a panel: the kernel refuses (below)
        b = blocks(10, 2 * outputs if gated else outputs, 96, name)
        assert cpu.q_prepacked(b, qtype, 96) is not None
        for threads in (1, 2):
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                for rows in (64, 70, 140):   # 140: a pass of 128 rows of x, then 12
                    xr = x[:rows].contiguous()
                    want = torch.empty(rows, outputs)
                    assert cpu._kernel.q_linear_f32(xr.data_ptr(), b.data_ptr(), want.data_ptr(), rows, outputs, 96,
                                                    qtype, int(gated), threads) == 0
                    got = cpu.q_linear(xr, b, qtype, gated=gated)
                    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (gated, threads, rows)
                for rows in (cpu._kernel.prep_rows[gated], 33):
                    xr = x[3:3 + rows]   # rows without NaN: its tolerance
                    ref = reference.q_gated_linear(xr, b, qtype) if gated else reference.q_linear(xr, b, qtype)
                    torch.testing.assert_close(cpu.q_linear(xr, b, qtype, gated=gated), ref, rtol=1e-5, atol=1e-5)
            finally:
                torch.set_num_threads(before)
    if outputs % panel:
        b = blocks(10, 2 * outputs, 96, name)
        rp = cpu.q_prepacked(b, qtype, 96)
        y = torch.empty(64, outputs)
        assert cpu._kernel.q_linear_prepacked_f32(x.data_ptr(), rp.data_ptr(), y.data_ptr(), 64, outputs, 96, qtype,
                                                  1, 1) == -1
        got = cpu.q_linear(x[:64].contiguous(), b, qtype, gated=True)   # the blocks' panels then
        torch.testing.assert_close(got[3:], reference.q_gated_linear(x[3:64], b, qtype), rtol=1e-5, atol=1e-5)


def test_the_repack_follows_the_weight():
    """A weight written in place (its version moves) is repacked: the kernel never reads a stale repack."""
    require_library()
    qtype = int(QTYPES["Q4_1"])
    b, x = blocks(2, 8, 64, "Q4_1"), torch.randn(1, 64)
    first = cpu.q_repacked(b, qtype, 64)
    assert cpu.q_repacked(b, qtype, 64) is first                       # kept while the blocks are unchanged
    before = cpu.q_linear(x, b, qtype)
    b[0, 4:20] = 0                                                     # row 0's first block's nibbles: all weights m
    assert cpu.q_repacked(b, qtype, 64) is not first
    after = cpu.q_linear(x, b, qtype)
    assert not torch.equal(before[0, 0], after[0, 0]) and torch.equal(before[0, 1:], after[0, 1:])
    assert torch.allclose(after, reference.q_linear(x, b, qtype), rtol=1e-5, atol=1e-5)
    # and the panel repack, which the panel rows read
    xs = torch.randn(cpu._kernel.prep_rows[False], 64)
    first = cpu.q_prepacked(b, qtype, 64)
    before = cpu.q_linear(xs, b, qtype)
    b[1, 4:20] = 0
    assert cpu.q_prepacked(b, qtype, 64) is not first
    after = cpu.q_linear(xs, b, qtype)
    assert not torch.equal(before[:, 1], after[:, 1]) and torch.equal(before[:, 0], after[:, 0])
    assert torch.allclose(after, reference.q_linear(xs, b, qtype), rtol=1e-5, atol=1e-5)
