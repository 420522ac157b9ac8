"""The C kernels (model/native.c, through native.py) against the eager ones.

The decode attention against gather + SDPA on random caches: head sizes it specializes (64, 128), others its
vector loops take (80) and ones they do not (36, 256), grouped and plain heads, contexts of one token, of a
whole block and past it, block tables padded past the context. The packed linear layers against F.linear
over every tile shape; RMSNorm (with and without the residual add), RoPE and SiLU-and-mul against theirs.
Where they cannot run (no compiler, float64 tensors, layouts they do not take) native mode runs eager
instead of failing."""
import logging

import pytest
import torch

from devharness.model import kernels, native


def _case(seed: int, batch: int, hq: int, hkv: int, d: int, block_size: int, lens: list[int]):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    width = max(-(-n // block_size) for n in lens) + 1     # one padding column past the longest row
    tables = torch.randint(0, num_blocks, (batch, width), generator=g)
    q = torch.randn(batch, hq, d, generator=g)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


DECODE_CASES = [   # (query heads, KV heads, head size, block size, contexts, query scale)
    (9, 3, 64, 16, [1, 16, 17, 40, 130], 1.0),
    (4, 4, 128, 8, [3, 8, 9], 1.0),
    (6, 2, 80, 16, [33, 1], 1.0),
    (2, 1, 64, 4, [5], 1.0),
    (4, 2, 36, 16, [7, 40], 1.0),        # a head size no vector width divides: the scalar loops
    (2, 2, 256, 16, [19], 1.0),          # wider than the vector loops keep in registers
    (10, 2, 64, 16, [20, 77], 1.0),      # 5 query heads a KV head: their values added 4 + 1 (2 + 2 + 1) at a time
    (8, 1, 128, 16, [33, 50], 1.0),      # 8 at head size 128: 2 at a time (1 with 8-wide vectors)
    (9, 3, 64, 16, [70, 200], 12.0),     # sharp scores: the running maximum moves on by more than 8 (rescales)
]


@pytest.mark.parametrize("hq, hkv, d, block_size, lens, q_scale", DECODE_CASES)
def test_native_decode_matches_eager(hq, hkv, d, block_size, lens, q_scale):
    if native.decode_kernel() is None:
        pytest.fail("the native kernel did not build on this machine (a C compiler is part of the set-up)")
    q, k_cache, v_cache, tables, context_lens = _case(len(lens) + d, len(lens), hq, hkv, d, block_size, lens)
    q = q * q_scale
    scale = d ** -0.5
    expected = kernels.paged_decode(q, k_cache, v_cache, tables, context_lens, scale)
    got = native.paged_decode(q, k_cache, v_cache, tables, context_lens, scale)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_without_a_compiler_native_mode_runs_eager(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("DEVHARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_kernel", None)
    q, k_cache, v_cache, tables, lens = _case(0, 2, 4, 2, 64, 16, [5, 20])
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        out = kernels.native_decode(q, k_cache, v_cache, tables, lens, 0.125)
    assert native.decode_kernel() is None
    assert "native kernels unavailable" in caplog.text and "no-such-cc" in caplog.text
    torch.testing.assert_close(out, kernels.paged_decode(q, k_cache, v_cache, tables, lens, 0.125))
    # The linear layers in native mode fall back too.
    x, w = torch.randn(5, 24), torch.randn(40, 24)
    assert native.packed_weight(w) is None
    with kernels.use("native"):
        torch.testing.assert_close(kernels.linear(x, w), torch.nn.functional.linear(x, w))


def test_tensors_it_does_not_take_run_eager(monkeypatch):
    calls = []
    monkeypatch.setattr(native, "paged_decode", lambda *a: calls.append(a))
    q, k_cache, v_cache, tables, lens = (t.double() if t.is_floating_point() else t
                                         for t in _case(1, 2, 4, 2, 64, 16, [5, 20]))
    out = kernels.native_decode(q, k_cache, v_cache, tables, lens, 0.125)
    assert not calls and out.dtype == torch.float64


@pytest.mark.parametrize("debugging, compile, native_kernels, mode", [
    (False, False, True, "native"),      # the default
    (False, False, False, "eager"),
    (False, True, True, "compiled"),
    (True, False, True, "eager"),        # debug mode: eager whatever is asked
    (True, True, True, "eager"),
])
def test_the_worker_runs_eager_kernels_in_debug_mode(debugging, compile, native_kernels, mode):
    from devharness.config import ModelConfig
    from devharness.worker.worker import kernel_mode
    assert kernel_mode(ModelConfig(compile=compile, native_kernels=native_kernels), debugging) == mode


def test_a_table_that_points_outside_the_cache_is_an_error_not_a_read(monkeypatch):
    """Like eager's index_select, the C kernel refuses a block id the cache does not have, or a context longer
    than its table, instead of reading past the cache."""
    if native.decode_kernel() is None:
        pytest.fail("the native kernel did not build on this machine")
    q, k_cache, v_cache, tables, lens = _case(2, 2, 4, 2, 64, 16, [5, 20])
    outside = tables.clone()
    outside[1, 1] = k_cache.shape[0]            # row 1's second block: one past the cache
    with pytest.raises(IndexError, match="outside the cache's 64"):
        native.paged_decode(q, k_cache, v_cache, outside, lens, 0.125)
    with pytest.raises(IndexError, match="3 wide"):
        native.paged_decode(q, k_cache, v_cache, tables, torch.tensor([5, 49]), 0.125)   # 4 blocks needed
    torch.testing.assert_close(native.paged_decode(q, k_cache, v_cache, tables, lens, 0.125),
                               kernels.paged_decode(q, k_cache, v_cache, tables, lens, 0.125))


def test_an_unknown_kernel_mode_is_named():
    with pytest.raises(ValueError, match="kernel mode 'fast': must be one of eager, native, compiled"):
        with kernels.use("fast"):
            pass


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 11, 12, 13, 25, 64, 256, 1029])
@pytest.mark.parametrize("out_features, in_features", [(1, 1), (7, 3), (16, 24), (17, 67), (40, 576), (100, 33)])
def test_packed_linear_matches_f_linear(rows, out_features, in_features):
    """Every tile shape (whole tiles of rows, the 8/4/2/1 remainders), panels whole and partial, an odd panel
    count, widths of one, a prefill chunk's rows; with a bias through kernels.linear in native mode."""
    if native.decode_kernel() is None:
        pytest.fail("the native kernels did not build on this machine")
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    got = native.packed_linear(x, native.packed_weight(w), out_features)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
    calls = []
    original = native.packed_linear
    try:
        native.packed_linear = lambda *a: calls.append(a) or original(*a)
        with kernels.use("native"):
            with_bias = kernels.linear(x, w, b)
    finally:
        native.packed_linear = original
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
def test_linear_argmax_gives_the_packed_products_argmax(threads):
    """Greedy tokens straight from the LM head (kernels.linear_argmax): the index torch's max(dim=-1) gives over the
    packed product's first num_valid columns, ties to the first, the first NaN above every number, for every
    split of the panels among threads."""
    if native.decode_kernel() is None:
        pytest.fail("the native kernels did not build on this machine")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for x, w, num_valid in _linear_argmax_cases(torch.Generator().manual_seed(threads)):
            want = native.packed_linear(x, native.packed_weight(w), w.shape[0])[:, :num_valid].max(dim=-1).indices
            assert torch.equal(native.packed_linear_argmax(x, native.packed_weight(w), w.shape[0], num_valid), want), \
                (x.shape, w.shape, num_valid)
            with kernels.use("native"):
                assert torch.equal(kernels.linear_argmax(x, w, num_valid), want)
    finally:
        torch.set_num_threads(previous)
    x, w = torch.randn(3, 8), torch.randn(20, 8)
    assert kernels.linear_argmax(x, w, 20) is None                   # outside native mode: the caller's logits
    with kernels.use("native"):
        assert kernels.linear_argmax(x.double(), w.double(), 20) is None
        with pytest.raises(ValueError, match="21 columns of 20"):
            kernels.linear_argmax(x, w, 21)


def test_the_other_vector_width_linear_argmax(other_vector_width):
    for x, w, num_valid in _linear_argmax_cases(torch.Generator().manual_seed(3)):
        want = native.packed_linear(x, native.packed_weight(w), w.shape[0])[:, :num_valid].max(dim=-1).indices
        assert torch.equal(native.packed_linear_argmax(x, native.packed_weight(w), w.shape[0], num_valid), want)


def test_a_packed_weight_is_packed_again_when_the_weight_changes():
    """The pack follows its weight: written in place (a fault, a reload) or given new storage, the next call
    packs again instead of computing with the old values; outside native mode no pack is used."""
    if native.decode_kernel() is None:
        pytest.fail("the native kernels did not build on this machine")
    x = torch.randn(4, 32)
    layer = torch.nn.Linear(32, 48, bias=False)
    w = layer.weight.detach().requires_grad_(False)
    with kernels.use("native"):
        first = kernels.linear(x, w)
        with torch.no_grad():
            w.mul_(2)                                   # in place: the version moves
        torch.testing.assert_close(kernels.linear(x, w), 2 * first, rtol=1e-5, atol=1e-5)
        w.data = torch.randn(48, 32)                    # new storage
        torch.testing.assert_close(kernels.linear(x, w), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
        assert kernels.linear(x[:, :0], torch.empty(48, 0)).abs().sum() == 0   # K = 0: zeros, like F.linear
    n_packs = len(native._packs)
    with kernels.use("eager"):
        kernels.linear(x, torch.randn(8, 32))
    assert len(native._packs) == n_packs                # eager mode packs nothing


@pytest.mark.parametrize("shape", [(1, 576), (32, 576), (300, 64), (5, 3, 16)])
def test_native_norms_match_eager(shape):
    """RMSNorm over the last dimension (the per-head norms have three), with and without the residual add, in
    native mode against the eager kernels; large enough inputs run on several threads."""
    if native.decode_kernel() is None:
        pytest.fail("the native kernels did not build on this machine")
    g = torch.Generator().manual_seed(sum(shape))
    # Small values: eps (1e-5) is then a good part of the mean square, so a kernel that drops it shows.
    x, r = torch.randn(*shape, generator=g) * 3e-3, torch.randn(*shape, generator=g) * 3e-3
    w = torch.randn(shape[-1], generator=g)
    expected, (expected_normed, expected_sum) = kernels.rms_norm(x, w, 1e-5), kernels.add_rms_norm(x, r, w, 1e-5)
    with kernels.use("native"):
        got, (got_normed, got_sum) = kernels.rms_norm(x, w, 1e-5), kernels.add_rms_norm(x, r, w, 1e-5)
    assert native.rms_norm(x, w, 1e-5) is not None
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_normed, expected_normed, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_sum, expected_sum)      # the residual stream's add is exact


def test_native_rope_matches_eager_on_a_strided_query():
    """q and k are views into the fused qkv output (rows wider than their heads): rotated in place of a copy."""
    if native.decode_kernel() is None:
        pytest.fail("the native kernels did not build on this machine")
    from devharness.model.layers import RotaryEmbedding
    t, hq, hkv, d = 7, 4, 2, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    q, k = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    cos, sin = RotaryEmbedding(d, 512, 10000.0, None)._tables(torch.tensor([0, 3, 5, 100, 101, 200, 511]),
                                                            torch.float32)
    with kernels.use("native"):
        got_q, got_k = kernels.rotate(q, cos, sin), kernels.rotate(k, cos, sin)
    assert native.rotate(q, cos, sin) is not None
    torch.testing.assert_close(got_q, kernels.rotate(q, cos, sin), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, kernels.rotate(k, cos, sin), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows, inter", [(1, 8), (3, 1536), (64, 1536), (2, 13)])
def test_native_silu_and_mul_matches_eager(rows, inter):
    """Whole vectors and a tail, one thread and several; its exp holds to float32 over the range where SiLU
    is not 0 or x (inputs of magnitude up to ~90)."""
    if native.decode_kernel() is None:
        pytest.fail("the native kernels did not build on this machine")
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)) * 30
    gate_up[0, :min(inter, 4)] = torch.tensor([-89.0, -87.5, 88.5, 0.0])[:min(inter, 4)]
    with kernels.use("native"):
        got = kernels.silu_and_mul(gate_up)
    assert native.silu_and_mul(gate_up) is not None
    torch.testing.assert_close(got, kernels.silu_and_mul(gate_up), rtol=2e-6, atol=1e-6)


def test_layouts_the_small_kernels_do_not_take_run_eager():
    """A non-contiguous input, float64, a shape mismatch: the C kernels decline and the eager ones run."""
    x = torch.randn(8, 32)
    w = torch.randn(32)
    assert native.rms_norm(x.t(), torch.randn(8), 1e-5) is None                   # not contiguous
    assert native.rms_norm(x.double(), w.double(), 1e-5) is None
    assert native.rms_norm(x, w, 1e-5, residual=torch.randn(4, 32)) is None      # residual of another shape
    assert native.rotate(torch.randn(3, 2, 64).transpose(0, 1), torch.randn(2, 1, 64), torch.randn(2, 1, 64)) is None
    assert native.silu_and_mul(torch.randn(4, 7)) is None                        # not gate and up halves
    with kernels.use("native"):
        torch.testing.assert_close(kernels.rms_norm(x.t(), torch.ones(8), 1e-5),
                                   torch.nn.functional.rms_norm(x.t(), (8,), torch.ones(8), 1e-5))


@pytest.mark.parametrize("rows, inter, in_features", [(1, 16, 8), (13, 48, 33), (64, 1536, 576), (256, 32, 7),
                                                    (1029, 64, 96)])
def test_gated_linear_matches_the_projection_then_silu_and_mul(rows, inter, in_features):
    """The MLP's gate/up product and SiLU-and-mul in one kernel (its panels interleaved gate, up, gate, ...)."""
    if native.decode_kernel() is None:
        pytest.fail("the native kernels did not build on this machine")
    g = torch.Generator().manual_seed(rows + inter)
    x, w = torch.randn(rows, in_features, generator=g), torch.randn(2 * inter, in_features, generator=g)
    expected = kernels.silu_and_mul(torch.nn.functional.linear(x, w))
    with kernels.use("native"):
        got = kernels.gated_linear(x, w)
    assert got is not None
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * in_features ** 0.5)


def test_gated_linear_declines_what_it_does_not_take():
    """Eager mode, a bias, an intermediate size no panel divides, no rows: None, and the MLP runs the
    projection and SiLU-and-mul as two steps."""
    x, w = torch.randn(4, 8), torch.randn(2 * 16, 8)
    assert kernels.gated_linear(x, w) is None                                   # eager mode
    with kernels.use("native"):
        assert kernels.gated_linear(x, w, torch.randn(32)) is None               # a bias
        assert kernels.gated_linear(x, torch.randn(2 * 12, 8)) is None           # 12 columns: no whole panels
        assert kernels.gated_linear(torch.randn(0, 8), w) is None


def test_a_width_mismatch_in_native_mode_is_f_linears_error_not_a_misread_pack():
    """x with fewer features than the weight: the packed kernel would read the pack as another layout and
    answer garbage. Native mode hands such a call to F.linear, which names the mismatch, and a pack used with
    the wrong width is a ValueError."""
    if native.decode_kernel() is None:
        pytest.fail("the native kernels did not build on this machine")
    x, w = torch.randn(4, 24), torch.randn(32, 32)
    with kernels.use("native"):
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            kernels.linear(x, w)
        assert kernels.gated_linear(x, w) is None
    with pytest.raises(ValueError, match="x has 24 features"):
        native.packed_linear(x, native.packed_weight(w), 32)
    with pytest.raises(ValueError, match="x has 24 features"):
        native.packed_gated_linear(x, native.packed_gated_weight(w), 16)


@pytest.fixture
def other_vector_width(monkeypatch):
    """The kernels built for the vector width this machine does not pick (-DVW=16 on AVX2, -DVW=8 on AVX-512:
    GCC's vector extensions split or keep the vectors), so that both widths' code (tile shapes, panel width,
    the transposing sums) runs here; the packs made for it kept apart."""
    if native.decode_kernel() is None:
        pytest.fail("the native kernels did not build on this machine")
    width = 8 if native._kernel.panel == 16 else 16
    lib = native._build((f"-DVW={width}",))
    assert lib.panel == width
    monkeypatch.setattr(native, "_kernel", lib)
    monkeypatch.setattr(native, "_packs", {})
    monkeypatch.setattr(native, "_gated_packs", {})
    return width


def test_the_other_vector_width_matches_eager(other_vector_width):
    for hq, hkv, d, block_size, lens, q_scale in DECODE_CASES:
        q, k_cache, v_cache, tables, context_lens = _case(d, len(lens), hq, hkv, d, block_size, lens)
        q = q * q_scale
        torch.testing.assert_close(native.paged_decode(q, k_cache, v_cache, tables, context_lens, d ** -0.5),
                                   kernels.paged_decode(q, k_cache, v_cache, tables, context_lens, d ** -0.5),
                                   rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(7)
    for rows in (1, 3, 7, 8, 12, 13, 64):
        for out_features, in_features in ((17, 67), (40, 576), (100, 33)):
            x, w = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)
            torch.testing.assert_close(native.packed_linear(x, native.packed_weight(w), out_features),
                                       torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)
        x, w = torch.randn(rows, 33, generator=g), torch.randn(2 * 48, 33, generator=g)
        torch.testing.assert_close(native.packed_gated_linear(x, native.packed_gated_weight(w), 48),
                                   kernels.silu_and_mul(torch.nn.functional.linear(x, w)), rtol=1e-4, atol=1e-4)
    gate_up = torch.randn(5, 2 * 40, generator=g)
    torch.testing.assert_close(native.silu_and_mul(gate_up), kernels.silu_and_mul(gate_up), rtol=2e-6, atol=1e-6)


def _kv_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.randn(6, 4, 3, 16, generator=g), torch.randn(6, 4, 3, 16, generator=g)
    qkv = torch.randn(5, 9 * 16, generator=g)            # v: a strided view, as the attention's split gives it
    k = torch.randn(5, 3, 16, generator=g)
    v = qkv[:, 6 * 16:].view(5, 3, 16)
    return k_cache, v_cache, torch.tensor([0, 5, 23, 9, 12]), k, v


def test_native_kv_write_matches_index_copy():
    """The step's keys and values into their slots in one C call, a strided v included, as index_copy_ does."""
    k_cache, v_cache, slots, k, v = _kv_case(0)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.view(-1, 3, 16).index_copy_(0, slots, k)
    expected_v.view(-1, 3, 16).index_copy_(0, slots, v)
    calls = []
    original = native.write_kv
    try:
        native.write_kv = lambda *a: calls.append(1) or original(*a)
        with kernels.use("native"):
            kernels.write_kv(k_cache, v_cache, slots, k, v)
    finally:
        native.write_kv = original
    assert calls and torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_a_kv_slot_outside_the_cache_is_an_error_and_writes_nothing():
    k_cache, v_cache, slots, k, v = _kv_case(1)
    before = k_cache.clone(), v_cache.clone()
    slots[3] = 6 * 4                                     # one past the last slot
    with pytest.raises(IndexError, match="outside the cache's 24"):
        native.write_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    with pytest.raises(IndexError):                      # eager's error, the same case
        kernels.write_kv(k_cache, v_cache, slots, k, v)


def test_kv_writes_it_does_not_take_run_eager():
    k_cache, v_cache, slots, k, v = _kv_case(2)
    assert not native.write_kv(k_cache.double(), v_cache.double(), slots, k.double(), v.double())
    assert not native.write_kv(k_cache, v_cache, slots.int(), k, v)                      # int32 slots
    k_heads_apart = k.transpose(1, 2).contiguous().transpose(1, 2)                      # head dim not contiguous
    assert not native.write_kv(k_cache, v_cache, slots, k_heads_apart, v)
    with kernels.use("native"):
        kernels.write_kv(k_cache, v_cache, slots, k_heads_apart, v)
    assert torch.equal(k_cache.view(-1, 3, 16)[slots], k) and torch.equal(v_cache.view(-1, 3, 16)[slots], v)


def test_a_dropped_weight_drops_its_pack():
    if native.decode_kernel() is None:
        pytest.fail("the native kernels did not build on this machine")
    # Gate and up halves of whole panels at either vector width (16 columns with AVX-512, 8 without).
    w = torch.randn(2 * 2 * native.decode_kernel().panel, 32)
    assert native.packed_weight(w) is not None and native.packed_gated_weight(w) is not None
    key = id(w)
    assert key in native._packs and key in native._gated_packs
    del w
    assert key not in native._packs and key not in native._gated_packs


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


def test_native_argmax_matches_max_indices():
    """The sampler's greedy pick: each row's first maximal index, the first NaN where a row has one, as
    x.max(dim=-1).indices gives; rows narrower than a vector, whole vectors and a scalar tail."""
    if native.decode_kernel() is None:
        pytest.fail("the native kernels did not build on this machine")
    for x in _argmax_cases():
        assert torch.equal(native.argmax(x), x.max(dim=-1).indices), x.shape
        with kernels.use("native"):
            assert torch.equal(kernels.argmax(x), x.max(dim=-1).indices)
    assert native.argmax(torch.randn(4, 10).t()) is None          # not contiguous: the caller runs torch's


def test_the_other_vector_width_argmax(other_vector_width):
    for x in _argmax_cases():
        assert torch.equal(native.argmax(x), x.max(dim=-1).indices), x.shape
