"""The C decode attention (model/native.py) against the eager one (gather + SDPA) on random caches: head
sizes it specializes (64, 128) and one it does not (80), grouped and plain heads, contexts of one token, of a
whole block and past it, block tables padded past the context; and where it cannot run (no compiler,
float64 tensors) the forward's native mode runs eager instead of failing."""
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


@pytest.mark.parametrize("hq, hkv, d, block_size, lens", [
    (9, 3, 64, 16, [1, 16, 17, 40, 130]),
    (4, 4, 128, 8, [3, 8, 9]),
    (6, 2, 80, 16, [33, 1]),
    (2, 1, 64, 4, [5]),
])
def test_native_decode_matches_eager(hq, hkv, d, block_size, lens):
    if native.decode_kernel() is None:
        pytest.fail("the native kernel did not build on this machine (a C compiler is part of the set-up)")
    q, k_cache, v_cache, tables, context_lens = _case(len(lens) + d, len(lens), hq, hkv, d, block_size, lens)
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
    assert "native decode attention unavailable" in caplog.text and "no-such-cc" in caplog.text
    torch.testing.assert_close(out, kernels.paged_decode(q, k_cache, v_cache, tables, lens, 0.125))


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
