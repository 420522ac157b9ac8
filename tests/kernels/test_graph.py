"""Recorded kernel calls (devharness/kernels/graph.py): a block of ops captured once and replayed on new values of
its inputs gives the bits the ops give on those values; a capture is sealed only where its calls' memory is the
kept, input or lasting tensors' and only the kernels computed; a replay stops at a call's error code."""
from __future__ import annotations

import pytest
import torch

from devharness.kernels import cpu, graph
from tests.kernels.quant_cases import QTYPES, blocks


def _block(fast, x, residual, norm_w, qkv, gate_up):
    """A layer's first ops, as the model calls them: the residual add and norm, a quantized product, a gated one."""
    h, res = fast.add_rms_norm(x, residual, norm_w, 1e-5)
    return fast.q_gated_linear(fast.q_linear(h, qkv, int(QTYPES["Q4_1"])), gate_up, int(QTYPES["Q8_0"])), res


def _inputs(seed, rows=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g)


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_a_replay_gives_the_ops_bits_on_new_inputs(fast, rows):
    norm_w = torch.rand(64) + 0.5
    qkv, gate_up = blocks(1, 64, 64, "Q4_1"), blocks(2, 64, 64, "Q8_0")
    x, residual = _inputs(0, rows)
    _block(fast, x.clone(), residual.clone(), norm_w, qkv, gate_up)   # the weights' repacks made: not in the capture
    inputs, lasting = [x, residual], [norm_w, qkv, gate_up]
    with fast.watch() as watch:
        with fast.capture("block") as rec:
            out = _block(fast, x, residual, norm_w, qkv, gate_up)
    assert watch.computed() == {}   # only the kernels computed
    assert rec.seal(inputs, lasting, out), rec.refused
    for seed in (1, 2):
        new_x, new_res = _inputs(seed, rows)
        x.copy_(new_x)
        residual.copy_(new_res)
        assert rec.replay()
        want = _block(fast, new_x, new_res, norm_w, qkv, gate_up)
        assert all(torch.equal(a, b) for a, b in zip(out, want))


def test_a_torch_op_inside_is_seen_and_memory_torch_made_is_refused(fast):
    norm_w, qkv = torch.rand(64) + 0.5, blocks(1, 96, 64, "Q4_1")
    x, residual = _inputs(3)
    fast.q_linear(x, qkv, int(QTYPES["Q4_1"]))
    with fast.watch() as watch:
        with fast.capture("bias") as rec:
            y = fast.q_linear(x, qkv, int(QTYPES["Q4_1"])).add_(1.0)   # a bias torch adds: the replay would not
    assert "aten::add_" in watch.computed()["bias"]
    assert rec.seal([x], [qkv], [y])   # its memory is fine: only the Watch sees the add
    with fast.capture("made by torch") as rec:
        h = fast.rms_norm(x * 2, norm_w, 1e-5)   # x * 2: a tensor torch made, which a replay would not refill
    assert not rec.seal([x], [norm_w], [h]) and "took memory no kept, input or lasting tensor holds" in rec.refused
    assert rec.calls == [] and rec.kept == []
    with fast.capture("an output of torch's") as rec:
        h = fast.rms_norm(x, norm_w, 1e-5) * 2
    assert not rec.seal([x], [norm_w], [h]) and rec.refused == "an output is not what a recorded call wrote"


def test_a_capture_that_prepares_a_weight_is_refused_for_now(fast):
    qkv = blocks(4, 32, 64, "Q8_0")
    x, _ = _inputs(4)
    with fast.capture("first use") as rec:
        y = fast.q_linear(x, qkv, int(QTYPES["Q8_0"]))   # makes the repack
    assert not rec.seal([x], [qkv], [y]) and rec.again and "q_repack_f32" in rec.refused
    with fast.capture("second use") as rec:
        y = fast.q_linear(x, qkv, int(QTYPES["Q8_0"]))
    assert rec.seal([x], [qkv], [y]) and not rec.again


def test_one_capture_at_a_time_and_other_threads_untouched(fast):
    import threading
    x, _ = _inputs(5)
    norm_w = torch.rand(64)
    other = []
    with fast.capture("outer") as outer:
        with fast.capture("inner") as inner:
            fast.rms_norm(x, norm_w, 1e-5)
        t = threading.Thread(target=lambda: other.append(fast.rms_norm(x, norm_w, 1e-5)))
        t.start()
        t.join()
    assert inner.refused == "no capture here now (another one runs)" and inner.again
    assert len(outer.calls) == 1 and len(other) == 1   # the other thread's call ran, unrecorded
    assert cpu._kernel is cpu.library() and not isinstance(cpu._kernel, graph._Recorder)


def test_a_replay_stops_at_an_error_code(fast):
    from tests.kernels.test_ops import _decode_step
    args = list(_decode_step(7, 4, 2, 64, 16, [5, 20]))
    slots = args[7]
    with fast.capture("attention") as rec:
        out = fast.decode_attention(*args)
    assert rec.seal([args[0], args[1], args[2], args[3], args[4], slots, args[8], args[9]], [args[5], args[6]],
                    [out])
    assert rec.replay()
    slots[1] = args[5].shape[0] * args[5].shape[1]   # past the cache: the kernel refuses it, writing nothing
    assert not rec.replay()
