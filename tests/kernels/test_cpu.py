"""The C kernels (devharness/kernels/native.c, through cpu.py) and the fast ops over them (fast.py) against the
reference kernels (reference.py).

The decode attention against gather + SDPA on random caches: head sizes it specializes (64, 128), others its
vector loops take (80) and ones they do not (36, 256), grouped and plain heads, contexts of one token, of a
whole block and past it, block tables padded past the context. The packed linear layers against F.linear
over every tile shape; RMSNorm (with and without the residual add), RoPE and SiLU-and-mul against theirs.
Where they cannot run (no compiler, float64 tensors, layouts they do not take) the fast ops run the reference
instead of failing. (tests/kernels/test_ops.py holds every op of the registry to its reference over edge inputs.)"""
import logging

import pytest
import torch

from devharness.kernels import Kernels, cpu, kernels_for, reference, reference_kernels
from tests.kernels.conftest import DECODE_CASES, require_library


def _case(seed: int, batch: int, hq: int, hkv: int, d: int, block_size: int, lens: list[int]):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    width = max(-(-n // block_size) for n in lens) + 1     # one padding column past the longest row
    tables = torch.randint(0, num_blocks, (batch, width), generator=g)
    q = torch.randn(batch, hq, d, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


@pytest.mark.parametrize("hq, hkv, d, block_size, lens, q_scale", DECODE_CASES)
def test_cpu_decode_matches_the_reference(hq, hkv, d, block_size, lens, q_scale):
    require_library()
    q, k_cache, v_cache, tables, context_lens = _case(len(lens) + d, len(lens), hq, hkv, d, block_size, lens)
    q = q * q_scale
    scale = d ** -0.5
    expected = reference.paged_decode(q, k_cache, v_cache, tables, context_lens, scale)
    got = cpu.paged_decode(q, k_cache, v_cache, tables, context_lens, scale)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_without_a_compiler_the_fast_backend_runs_the_reference(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("DEVHARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_kernel", None)
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        kernels = kernels_for("fast")
    warnings = [r for r in caplog.records if "the fast kernels cannot be built here" in r.getMessage()]
    assert len(warnings) == 1 and "no-such-cc" in warnings[0].getMessage()
    assert isinstance(kernels, Kernels) and kernels.backend == "reference"
    assert set(kernels.choices.values()) == {"library"}
    assert cpu.library() is None
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        again = kernels_for("fast")
    assert again.backend == "reference"
    assert "the fast kernels cannot be built here" not in caplog.text   # warned once, not per call
    # The kernels it gives, and the fast ops themselves, run the reference.
    q, k_cache, v_cache, tables, lens = _case(0, 2, 4, 2, 64, 16, [5, 20])
    from devharness.kernels import fast
    ops = fast.registered()
    want = reference.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(kernels.paged_decode(q, k_cache, v_cache, tables, lens, 0.125), want)
    torch.testing.assert_close(ops["paged_decode"](q, k_cache, v_cache, tables, lens, 0.125), want)
    x, w = torch.randn(5, 24), torch.randn(40, 24)
    assert cpu.packed_weight(w) is None
    torch.testing.assert_close(kernels.linear(x, w), torch.nn.functional.linear(x, w))
    torch.testing.assert_close(ops["linear"](x, w), torch.nn.functional.linear(x, w))


def test_tensors_it_does_not_take_run_the_reference(monkeypatch, fast):
    calls = []
    monkeypatch.setattr(cpu, "paged_decode", lambda *a: calls.append(a))
    q, k_cache, v_cache, tables, lens = (t.double() if t.is_floating_point() else t
                                         for t in _case(1, 2, 4, 2, 64, 16, [5, 20]))
    out = fast.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
    assert not calls and out.dtype == torch.float64
    torch.testing.assert_close(out, reference.paged_decode(q, k_cache, v_cache, tables, lens, 0.125))


@pytest.mark.parametrize("debugging", [False, True])
@pytest.mark.parametrize("asked, backend", [(None, "fast"),   # the default
                                            ("fast", "fast"),
                                            ("reference", "reference")])
def test_debug_mode_runs_the_kernels_the_config_names(debugging, asked, backend, monkeypatch):
    """Debug mode runs serving's kernels: the worker's runner and its model get the backend of
    ModelConfig.kernels whether or not debug mode is on."""
    require_library()
    from devharness.config import ModelConfig
    from devharness.engine.args import EngineArgs
    from devharness.model.loader import resolve_model
    from devharness.worker.worker import Worker
    kwargs = {} if asked is None else {"kernels": asked}
    assert ModelConfig(**kwargs).kernels == backend
    config = EngineArgs(debug=debugging, **kwargs).create_engine_config()
    assert config.debug.enabled == debugging and config.model.kernels == backend
    monkeypatch.setattr(Worker, "_init_debug", lambda self: None)   # no debugpy listener in the test process
    worker = Worker(config, resolve_model("tiny-llama"), 0, 64, own_process=False)
    worker.init_device()
    worker.load_model()
    assert worker.runner.kernels.backend == backend
    assert worker.runner.model.kernels is worker.runner.kernels


def test_an_unknown_kernel_backend_is_named():
    from devharness.config import ModelConfig
    with pytest.raises(ValueError, match="kernels='foo': must be one of reference, fast"):
        kernels_for("foo")
    with pytest.raises(ValueError, match="ModelConfig.kernels='foo': must be one of reference, fast"):
        ModelConfig(kernels="foo")


def test_a_table_that_points_outside_the_cache_is_an_error_not_a_read(fast):
    """Like the reference's index_select, the C kernel refuses a block id the cache does not have, or a context
    longer than its table, instead of reading past the cache; the fast op raises the same."""
    q, k_cache, v_cache, tables, lens = _case(2, 2, 4, 2, 64, 16, [5, 20])
    outside = tables.clone()
    outside[1, 1] = k_cache.shape[0]            # row 1's second block: one past the cache
    for decode in (cpu.paged_decode, fast.paged_decode):
        with pytest.raises(IndexError, match="outside the cache's 64"):
            decode(q, k_cache, v_cache, outside, lens, 0.125)
        with pytest.raises(IndexError, match="3 wide"):
            decode(q, k_cache, v_cache, tables, torch.tensor([5, 49]), 0.125)   # 4 blocks needed
        with pytest.raises(IndexError, match="does not hold"):                    # a table cut short
            decode(q, k_cache, v_cache, tables[:, :1], lens, 0.125)
    with pytest.raises(IndexError):
        reference.paged_decode(q, k_cache, v_cache, outside, lens, 0.125)
    torch.testing.assert_close(cpu.paged_decode(q, k_cache, v_cache, tables, lens, 0.125),
                               reference.paged_decode(q, k_cache, v_cache, tables, lens, 0.125))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 11, 12, 13, 25, 64, 256, 1029])
@pytest.mark.parametrize("out_features, in_features", [(1, 1), (7, 3), (16, 24), (17, 67), (40, 576), (100, 33)])
def test_packed_linear_matches_f_linear(rows, out_features, in_features, fast, monkeypatch):
    """Every tile shape (whole tiles of rows, the 8/4/2/1 remainders), panels whole and partial, an odd panel
    count, widths of one, a prefill chunk's rows; with a bias through the fast linear op."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    got = cpu.packed_linear(x, cpu.packed_weight(w), out_features)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
    calls = []
    original = cpu.packed_linear
    monkeypatch.setattr(cpu, "packed_linear", lambda *a: calls.append(a) or original(*a))
    with_bias = fast.linear(x, w, b)
    assert len(calls) == 1
    torch.testing.assert_close(with_bias, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)


def _linear_argmax_cases(g: torch.Generator):
    """(x, w, num_valid): every tile shape of rows, panels whole and partial, odd panel counts, padding columns
    past num_valid, equal logits in two columns, NaN columns, a NaN row, a row of -inf logits."""
    for rows in (1, 2, 5, 12, 13, 25, 128):
        for out_features, in_features, num_valid in ((1, 8, 1), (17, 24, 17), (40, 64, 37), (100, 33, 100),
                                                     (1000, 64, 997), (3000, 576, 3000)):
            x = torch.randn(rows, in_features, generator=g)
            w = torch.randn(out_features, in_features, generator=g)
            yield x, w, num_valid
            if out_features >= 17:
                tied = w.clone()
                tied[num_valid - 1] = tied[out_features // 3] = 4 * x[0] / x[0].norm()   # row 0's largest, twice
                yield x, tied, num_valid
                nan = w.clone()
                nan[num_valid - 2] = nan[out_features // 2] = float("nan")
                yield x, nan, num_valid
                odd = x.clone()
                odd[-1] = float("nan")
                if rows > 2:
                    odd[1] = 0.0
                    odd[1, 0] = float("inf")        # every logit of row 1 is +-inf (or NaN): the first largest
                yield odd, w, num_valid


@pytest.mark.parametrize("threads", [1, 2])
def test_linear_argmax_gives_the_packed_products_argmax(threads, fast):
    """Greedy tokens straight from the LM head (the fast linear_argmax op): the index torch's max(dim=-1) gives
    over the packed product's first num_valid columns, ties to the first, the first NaN above every number, for
    every split of the panels among threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for x, w, num_valid in _linear_argmax_cases(torch.Generator().manual_seed(threads)):
            want = cpu.packed_linear(x, cpu.packed_weight(w), w.shape[0])[:, :num_valid].max(dim=-1).indices
            assert torch.equal(cpu.packed_linear_argmax(x, cpu.packed_weight(w), w.shape[0], num_valid), want), \
                (x.shape, w.shape, num_valid)
            assert torch.equal(fast.linear_argmax(x, w, num_valid), want)
    finally:
        torch.set_num_threads(previous)
    x, w = torch.randn(3, 8), torch.randn(20, 8)
    # The reference kernels: argmax of the logits the caller would compute.
    assert torch.equal(reference_kernels().linear_argmax(x, w, 20),
                       torch.nn.functional.linear(x, w).max(dim=-1).indices)
    # What the C kernel does not take (float64): the fast op gives the reference's answer.
    assert torch.equal(fast.linear_argmax(x.double(), w.double(), 20),
                       reference.linear_argmax(x.double(), w.double(), 20))
    with pytest.raises(ValueError, match="21 columns of 20"):
        fast.linear_argmax(x, w, 21)


def test_the_other_vector_width_linear_argmax(other_vector_width):
    for x, w, num_valid in _linear_argmax_cases(torch.Generator().manual_seed(3)):
        want = cpu.packed_linear(x, cpu.packed_weight(w), w.shape[0])[:, :num_valid].max(dim=-1).indices
        assert torch.equal(cpu.packed_linear_argmax(x, cpu.packed_weight(w), w.shape[0], num_valid), want)


def test_a_packed_weight_is_packed_again_when_the_weight_changes(fast):
    """The pack follows its weight: written in place (a fault, a reload, an edit in a debugger) or given new
    storage, the next call packs again instead of computing with the old values, for the plain and for the gated
    product; the reference kernels use no pack."""
    x = torch.randn(4, 32)
    layer = torch.nn.Linear(32, 48, bias=False)
    w = layer.weight.detach().requires_grad_(False)
    first = fast.linear(x, w)
    with torch.no_grad():
        w.mul_(2)                                   # in place: the version moves
    torch.testing.assert_close(fast.linear(x, w), 2 * first, rtol=1e-5, atol=1e-5)
    w.data = torch.randn(48, 32)                    # new storage
    torch.testing.assert_close(fast.linear(x, w), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
    assert fast.linear(x[:, :0], torch.empty(48, 0)).abs().sum() == 0   # K = 0: zeros, like F.linear
    gate_up = torch.randn(2 * 2 * cpu.library().panel, 32)             # whole panels at either vector width
    first = fast.gated_linear(x, gate_up)
    with torch.inference_mode():                    # as in a forward: the version moves all the same
        gate_up.mul_(-1.5)
    torch.testing.assert_close(fast.gated_linear(x, gate_up), reference.gated_linear(x, gate_up),
                               rtol=1e-5, atol=1e-5)
    assert not torch.allclose(fast.gated_linear(x, gate_up), first)
    n_packs, n_gated = len(cpu._packs), len(cpu._gated_packs)
    plain = reference_kernels()
    plain.linear(x, torch.randn(8, 32))
    plain.gated_linear(x, torch.randn(2 * 16, 32))
    assert (len(cpu._packs), len(cpu._gated_packs)) == (n_packs, n_gated)   # the reference kernels pack nothing


@pytest.mark.parametrize("shape", [(1, 576), (32, 576), (300, 64), (5, 3, 16)])
def test_cpu_norms_match_the_reference(shape, fast):
    """RMSNorm over the last dimension (the per-head norms have three), with and without the residual add,
    through the fast ops against the reference; large enough inputs run on several threads."""
    g = torch.Generator().manual_seed(sum(shape))
    # Small values: eps (1e-5) is then a good part of the mean square, so a kernel that drops it shows.
    x, r = torch.randn(*shape, generator=g) * 3e-3, torch.randn(*shape, generator=g) * 3e-3
    w = torch.randn(shape[-1], generator=g)
    expected, (expected_normed, expected_sum) = reference.rms_norm(x, w, 1e-5), reference.add_rms_norm(x, r, w, 1e-5)
    got, (got_normed, got_sum) = fast.rms_norm(x, w, 1e-5), fast.add_rms_norm(x, r, w, 1e-5)
    assert cpu.rms_norm(x, w, 1e-5) is not None
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_normed, expected_normed, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_sum, expected_sum)      # the residual stream's add is exact


def test_cpu_rope_matches_the_reference_on_a_strided_query(fast):
    """q and k are views into the fused qkv output (rows wider than their heads): rotated in place of a copy."""
    from devharness.model.layers import RotaryEmbedding
    t, hq, hkv, d = 7, 4, 2, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    q, k = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    cos, sin = RotaryEmbedding(d, 512, 10000.0, None)._tables(torch.tensor([0, 3, 5, 100, 101, 200, 511]),
                                                            torch.float32)
    got_q, got_k = fast.rotate(q, cos, sin), fast.rotate(k, cos, sin)
    assert cpu.rotate(q, cos, sin) is not None
    torch.testing.assert_close(got_q, reference.rotate(q, cos, sin), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, reference.rotate(k, cos, sin), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows, inter", [(1, 8), (3, 1536), (64, 1536), (2, 13)])
def test_cpu_silu_and_mul_matches_the_reference(rows, inter, fast):
    """Whole vectors and a tail, one thread and several; its exp holds to float32 over the range where SiLU
    is not 0 or x (inputs of magnitude up to ~90)."""
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)) * 30
    gate_up[0, :min(inter, 4)] = torch.tensor([-89.0, -87.5, 88.5, 0.0])[:min(inter, 4)]
    got = fast.silu_and_mul(gate_up)
    assert cpu.silu_and_mul(gate_up) is not None
    torch.testing.assert_close(got, reference.silu_and_mul(gate_up), rtol=2e-6, atol=1e-6)


def test_layouts_the_small_kernels_do_not_take_run_the_reference(fast):
    """A non-contiguous input, float64, a shape mismatch: the C kernels decline and the fast ops run the
    reference."""
    x = torch.randn(8, 32)
    w = torch.randn(32)
    assert cpu.rms_norm(x.t(), torch.randn(8), 1e-5) is None                   # not contiguous
    assert cpu.rms_norm(x.double(), w.double(), 1e-5) is None
    assert cpu.rms_norm(x, w, 1e-5, residual=torch.randn(4, 32)) is None      # residual of another shape
    assert cpu.rotate(torch.randn(3, 2, 64).transpose(0, 1), torch.randn(2, 1, 64), torch.randn(2, 1, 64)) is None
    assert cpu.silu_and_mul(torch.randn(4, 7)) is None                        # not gate and up halves
    torch.testing.assert_close(fast.rms_norm(x.t(), torch.ones(8), 1e-5),
                               torch.nn.functional.rms_norm(x.t(), (8,), torch.ones(8), 1e-5))
    assert torch.equal(fast.add_rms_norm(x.double(), x.double(), w.double(), 1e-5)[0],
                       reference.add_rms_norm(x.double(), x.double(), w.double(), 1e-5)[0])
    strided = torch.randn(3, 2, 64).transpose(0, 1)
    cos, sin = torch.randn(2, 1, 64), torch.randn(2, 1, 64)
    assert torch.equal(fast.rotate(strided, cos, sin), reference.rotate(strided, cos, sin))
    odd = torch.randn(4, 7)
    with pytest.raises(RuntimeError):   # the reference's error: halves of 4 and 3 columns do not multiply
        reference.silu_and_mul(odd)
    with pytest.raises(RuntimeError):
        fast.silu_and_mul(odd)


@pytest.mark.parametrize("rows, inter, in_features", [(1, 16, 8), (13, 48, 33), (64, 1536, 576), (256, 32, 7),
                                                    (1029, 64, 96)])
def test_gated_linear_matches_the_projection_then_silu_and_mul(rows, inter, in_features, fast, monkeypatch):
    """The MLP's gate/up product and SiLU-and-mul in one kernel (its panels interleaved gate, up, gate, ...)."""
    g = torch.Generator().manual_seed(rows + inter)
    x, w = torch.randn(rows, in_features, generator=g), torch.randn(2 * inter, in_features, generator=g)
    expected = reference.silu_and_mul(torch.nn.functional.linear(x, w))
    calls = []
    original = cpu.packed_gated_linear
    monkeypatch.setattr(cpu, "packed_gated_linear", lambda *a: calls.append(a) or original(*a))
    got = fast.gated_linear(x, w)
    assert len(calls) == 1                                     # the one kernel ran
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * in_features ** 0.5)


def test_gated_linear_declines_what_it_does_not_take(fast, monkeypatch):
    """A bias, an intermediate size no panel divides, no rows: the C kernel declines and the fast op gives the
    reference's answer (the projection and SiLU-and-mul as two steps); the reference kernels never run it."""
    calls = []
    original = cpu.packed_gated_linear
    monkeypatch.setattr(cpu, "packed_gated_linear", lambda *a: calls.append(a) or original(*a))
    x, w, b = torch.randn(4, 8), torch.randn(2 * 16, 8), torch.randn(32)
    assert torch.equal(reference_kernels().gated_linear(x, w), reference.silu_and_mul(torch.nn.functional.linear(x, w)))
    assert torch.equal(fast.gated_linear(x, w, b), reference.gated_linear(x, w, b))                    # a bias
    twelve = torch.randn(2 * 12, 8)
    assert cpu.packed_gated_weight(twelve) is None
    assert torch.equal(fast.gated_linear(x, twelve), reference.gated_linear(x, twelve))    # 12: no whole panels
    none = fast.gated_linear(torch.randn(0, 8), w)
    assert none.shape == (0, 16) and torch.equal(none, reference.gated_linear(torch.randn(0, 8), w))
    assert not calls
    fast.gated_linear(x, w)
    assert len(calls) == 1                          # and takes what it does


def test_a_width_mismatch_is_f_linears_error_not_a_misread_pack(fast):
    """x with fewer features than the weight: the packed kernel would read the pack as another layout and
    answer garbage. The fast ops hand such a call to F.linear, which names the mismatch, and a pack used with
    the wrong width is a ValueError."""
    x, w = torch.randn(4, 24), torch.randn(32, 32)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        fast.linear(x, w)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        fast.gated_linear(x, w)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        fast.linear_argmax(x, w, 32)
    with pytest.raises(ValueError, match="x has 24 features"):
        cpu.packed_linear(x, cpu.packed_weight(w), 32)
    with pytest.raises(ValueError, match="x has 24 features"):
        cpu.packed_gated_linear(x, cpu.packed_gated_weight(w), 16)


def test_the_other_vector_width_matches_the_reference(other_vector_width):
    for hq, hkv, d, block_size, lens, q_scale in DECODE_CASES:
        q, k_cache, v_cache, tables, context_lens = _case(d, len(lens), hq, hkv, d, block_size, lens)
        q = q * q_scale
        torch.testing.assert_close(cpu.paged_decode(q, k_cache, v_cache, tables, context_lens, d ** -0.5),
                                   reference.paged_decode(q, k_cache, v_cache, tables, context_lens, d ** -0.5),
                                   rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(7)
    for rows in (1, 3, 7, 8, 12, 13, 64):
        for out_features, in_features in ((17, 67), (40, 576), (100, 33)):
            x, w = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)
            torch.testing.assert_close(cpu.packed_linear(x, cpu.packed_weight(w), out_features),
                                       torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
        x, w = torch.randn(rows, 33, generator=g), torch.randn(2 * 48, 33, generator=g)
        torch.testing.assert_close(cpu.packed_gated_linear(x, cpu.packed_gated_weight(w), 48),
                                   reference.silu_and_mul(torch.nn.functional.linear(x, w)), rtol=1e-4, atol=1e-4)
    gate_up = torch.randn(5, 2 * 40, generator=g)
    torch.testing.assert_close(cpu.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), rtol=2e-6, atol=1e-6)


def _kv_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.randn(6, 4, 3, 16, generator=g), torch.randn(6, 4, 3, 16, generator=g)
    qkv = torch.randn(5, 9 * 16, generator=g)            # v: a strided view, as the attention's split gives it
    k = torch.randn(5, 3, 16, generator=g)
    v = qkv[:, 6 * 16:].view(5, 3, 16)
    return k_cache, v_cache, torch.tensor([0, 5, 23, 9, 12]), k, v


def test_cpu_kv_write_matches_index_copy(fast, monkeypatch):
    """The step's keys and values into their slots in one C call, a strided v included, as index_copy_ does."""
    k_cache, v_cache, slots, k, v = _kv_case(0)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.view(-1, 3, 16).index_copy_(0, slots, k)
    expected_v.view(-1, 3, 16).index_copy_(0, slots, v)
    calls = []
    original = cpu.write_kv
    monkeypatch.setattr(cpu, "write_kv", lambda *a: calls.append(1) or original(*a))
    fast.write_kv(k_cache, v_cache, slots, k, v)
    assert calls and torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_a_kv_slot_outside_the_cache_is_an_error_and_writes_nothing(fast):
    k_cache, v_cache, slots, k, v = _kv_case(1)
    before = k_cache.clone(), v_cache.clone()
    slots[3] = 6 * 4                                     # one past the last slot
    with pytest.raises(IndexError, match="outside the cache's 24"):
        cpu.write_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    with pytest.raises(IndexError, match="outside the cache's 24"):   # the fast op: the same error
        fast.write_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    with pytest.raises(IndexError):                      # the reference's error, the same case
        reference.write_kv(k_cache, v_cache, slots, k, v)


def test_kv_writes_it_does_not_take_run_the_reference(fast):
    k_cache, v_cache, slots, k, v = _kv_case(2)
    assert not cpu.write_kv(k_cache.double(), v_cache.double(), slots, k.double(), v.double())
    assert not cpu.write_kv(k_cache, v_cache, slots.int(), k, v)                      # int32 slots
    k_heads_apart = k.transpose(1, 2).contiguous().transpose(1, 2)                   # head dim not contiguous
    assert not cpu.write_kv(k_cache, v_cache, slots, k_heads_apart, v)
    fast.write_kv(k_cache, v_cache, slots, k_heads_apart, v)
    assert torch.equal(k_cache.view(-1, 3, 16)[slots], k) and torch.equal(v_cache.view(-1, 3, 16)[slots], v)


def test_a_dropped_weight_drops_its_pack():
    require_library()
    # Gate and up halves of whole panels at either vector width (16 columns with AVX-512, 8 without).
    w = torch.randn(2 * 2 * cpu.library().panel, 32)
    assert cpu.packed_weight(w) is not None and cpu.packed_gated_weight(w) is not None
    key = id(w)
    assert key in cpu._packs and key in cpu._gated_packs
    del w
    assert key not in cpu._packs and key not in cpu._gated_packs


def _argmax_cases():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(12, 49157, generator=g)
    x[0, 100] = x[0, 2000] = x[0].max() + 1        # a tie: the first index
    x[1, 7] = x[1, 9000] = float("nan")            # NaN ranks above every number: the first NaN
    x[2, 49155] = float("nan")                     # a NaN in the scalar tail
    x[3] = 0.0                                     # all equal: index 0
    x[4] = float("-inf")
    x[5] = 1.0
    x[5, 49156] = 2.0                              # the maximum in the last, scalar, column
    x[6, 16] = float("inf")
    return [x] + [x[:, :w].contiguous() for w in (1, 5, 16, 17, 33)]


def test_cpu_argmax_matches_max_indices(fast):
    """The sampler's greedy pick: each row's first maximal index, the first NaN where a row has one, as
    x.max(dim=-1).indices gives; rows narrower than a vector, whole vectors and a scalar tail."""
    for x in _argmax_cases():
        assert torch.equal(cpu.argmax(x), x.max(dim=-1).indices), x.shape
        assert torch.equal(fast.argmax(x), x.max(dim=-1).indices)
    transposed = torch.randn(4, 10).t()
    assert cpu.argmax(transposed) is None          # not contiguous: the fast op runs the reference
    assert torch.equal(fast.argmax(transposed), transposed.max(dim=-1).indices)


def test_the_other_vector_width_argmax(other_vector_width):
    for x in _argmax_cases():
        assert torch.equal(cpu.argmax(x), x.max(dim=-1).indices), x.shape


def test_the_engine_calls_the_ops_without_the_dispatcher_unless_something_watches_it(fast):
    """The fast backend's ops run their implementation straight (no dispatcher a call), with the registered op's
    results; under a dispatch mode or torch's profiler they go through the registered op, which those see by name."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode
    from devharness.kernels import fast as fast_module
    x, res, w = torch.randn(3, 576), torch.randn(3, 576), torch.randn(576)
    dispatched = fast_module.registered()["add_rms_norm"](x, res, w, 1e-5)
    calls = []
    original = fast_module._add_rms_norm
    direct = fast_module._direct("add_rms_norm", lambda *a: calls.append(1) or original(*a),
                                 fast_module.registered()["add_rms_norm"])
    got = direct(x, res, w, 1e-5)
    assert calls and all(torch.equal(a, b) for a, b in zip(got, dispatched))
    assert all(torch.equal(a, b) for a, b in zip(fast.add_rms_norm(x, res, w, 1e-5), dispatched))

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))
    calls.clear()
    with Seen() as seen:
        direct(x, res, w, 1e-5)
    assert "devharness.add_rms_norm.default" in seen.ops and not calls
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fast.add_rms_norm(x, res, w, 1e-5)
    assert "devharness::add_rms_norm" in {e.key for e in prof.key_averages()}


def _decode_step_args(hq, hkv, d, block_size, lens, q_scale=1.0, seed=0):
    from tests.kernels.test_ops import _decode_step   # decode_attention's cases' arguments
    return list(_decode_step(seed, hq, hkv, d, block_size, lens, q_scale))


@pytest.mark.parametrize("hq, hkv, d, block_size, lens, q_scale", DECODE_CASES)
def test_decode_attention_is_its_parts_bit_for_bit(hq, hkv, d, block_size, lens, q_scale, fast):
    """The fused op's C call gives the bits of the fast rotate, write_kv and paged_decode called one by one (the
    same C code): its output and both caches, so that a step fused and one run op by op (a fault or a capture
    wraps a part) agree to the bit."""
    fused, parts = (_decode_step_args(hq, hkv, d, block_size, lens, q_scale) for _ in range(2))
    calls = []
    original = cpu.decode_attention
    try:
        cpu.decode_attention = lambda *a: calls.append(1) or original(*a)
        got = fast.decode_attention(*fused)
    finally:
        cpu.decode_attention = original
    q, k, v, cos, sin, k_cache, v_cache, slots, tables, context_lens, scale = parts
    q, k = fast.rotate(q, cos, sin), fast.rotate(k, cos, sin)
    fast.write_kv(k_cache, v_cache, slots, k, v)
    want = fast.paged_decode(q, k_cache, v_cache, tables, context_lens, scale)
    assert calls and got is not None
    assert torch.equal(got, want)
    assert torch.equal(fused[5], k_cache) and torch.equal(fused[6], v_cache)


def test_decode_attention_with_a_slot_outside_the_cache_is_an_index_error_and_writes_nothing(fast):
    args = _decode_step_args(4, 2, 64, 16, [5, 20])
    num_slots = args[5].shape[0] * args[5].shape[1]
    args[7][1] = num_slots                                # one past the last slot
    before = args[5].clone(), args[6].clone()
    for op in (cpu.decode_attention, fast.decode_attention):
        with pytest.raises(IndexError, match=f"outside the cache's {num_slots}"):   # write_kv's error
            op(*args)
        assert torch.equal(args[5], before[0]) and torch.equal(args[6], before[1])
    args[7][1] = -1
    with pytest.raises(IndexError, match=f"outside the cache's {num_slots}"):
        fast.decode_attention(*args)
    with pytest.raises(IndexError):                       # the reference's error, the same case
        reference.decode_attention(*args)


def test_decode_attention_with_a_table_outside_the_cache_is_an_index_error(fast):
    """As paged_decode's: a block the cache does not have, or a context longer than the table, is refused rather
    than read (the step's keys and values are written first, as the parts write them before attending)."""
    args = _decode_step_args(4, 2, 64, 16, [5, 20])
    outside = args[8].clone()
    outside[1, 1] = args[5].shape[0]
    for op in (cpu.decode_attention, fast.decode_attention):
        with pytest.raises(IndexError, match=f"outside the cache's {args[5].shape[0]}"):
            op(*args[:8], outside, *args[9:])
        with pytest.raises(IndexError, match="does not hold"):
            op(*args[:8], args[8][:, :1], *args[9:])
    with pytest.raises(IndexError):
        reference.decode_attention(*args[:8], outside, *args[9:])


def test_decode_attention_declines_what_it_does_not_take(fast):
    """Tensors the C call does not take give None from cpu.decode_attention; the op then runs its parts."""
    args = _decode_step_args(4, 2, 64, 16, [5, 20])
    declined = {
        "float64": [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args],
        "int32 slots": args[:7] + [args[7].int()] + args[8:],
        "q's heads not contiguous": [args[0].transpose(1, 2).contiguous().transpose(1, 2)] + args[1:],
        "an odd head size": _decode_step_args(4, 2, 5, 16, [5, 20]),
        "cos of another shape": args[:3] + [args[3][:, 0]] + args[4:],
        "query heads no multiple of the KV heads": [torch.randn(2, 3, 64)] + args[1:],
    }
    for what, bad in declined.items():
        assert cpu.decode_attention(*bad) is None, what
    got = fast.decode_attention(*declined["q's heads not contiguous"])
    torch.testing.assert_close(got, reference.decode_attention(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("where", ["key", "value"])
def test_prefill_attention_is_strictly_causal(where, threads, fast):
    """A NaN in a chunk's key or value at position p reaches the queries at p and after, never one before it (each
    row's outputs bit for bit those of the chunk without the NaN), in the chunk's own keys and in cached ones, in
    tiles that hold queries on both sides of p. SDPA's masked call, the op's reference, gives the NaN to every
    query of the chunk (a masked weight of 0 times NaN)."""
    require_library()
    g = torch.Generator().manual_seed(21)
    n, hq, hkv, d, bs = 40, 9, 3, 64, 16
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
    k_cache, v_cache = torch.randn(8, bs, hkv, d, generator=g), torch.randn(8, bs, hkv, d, generator=g)
    ids = torch.tensor([5, 2, 7, 0])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for context in (n, 60):   # the chunk's own keys; after 20 cached
            p = context - n + 17
            clean = cpu.prefill_attention(q, k, v, k_cache, v_cache, ids, context, d ** -0.5)
            kk, vv, kc, vc = k.clone(), v.clone(), k_cache.clone(), v_cache.clone()
            src = ({"key": kk, "value": vv}[where][p, 1] if context == n else
                   {"key": kc, "value": vc}[where][ids[p // bs], p % bs, 1])
            src[5] = float("nan")
            got = cpu.prefill_attention(q, kk, vv, kc, vc, ids, context, d ** -0.5)
            first = n - (context - p)   # the chunk's row at position p
            assert torch.equal(got[:first].view(torch.int32), clean[:first].view(torch.int32)), context
            reached = torch.zeros(n - first, hq, d, dtype=torch.bool)   # KV head 1's queries: all of a key's
            reached[:, 3:6, slice(None) if where == "key" else 5] = True  # row, a value's element 5
            assert torch.equal(got[first:].isnan(), reached), context
            assert torch.equal(got[first:][~reached].view(torch.int32), clean[first:][~reached].view(torch.int32))
            ref = reference.prefill_attention(q, kk, vv, kc, vc, ids, context, d ** -0.5)
            assert ref[:first, 3:6, 5].isnan().all()   # the reference's leak this kernel does not have
    finally:
        torch.set_num_threads(before)
