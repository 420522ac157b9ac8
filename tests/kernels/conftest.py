import pytest
import torch

import devharness.kernels as kernels_module
from devharness.kernels import OPS, cpu, kernels_for


def require_library():
    if cpu.library() is None:
        pytest.fail("the fast (C) kernels did not build on this machine (a C compiler is part of the set-up)")


@pytest.fixture
def fast(monkeypatch):
    """kernels_for("fast") with every op's custom kernel where it has one, whatever `devharness bench kernels
    --save` chose on this machine (a saved "library" choice would hand such an op its reference, and the tests
    would compare the reference with itself)."""
    require_library()
    monkeypatch.setattr(kernels_module, "saved_choices", dict)
    kernels = kernels_for("fast")
    assert kernels.backend == "fast"
    assert kernels.choices == {name: "custom" if op.custom else "library" for name, op in OPS.items()}
    return kernels


def set_threads(n: int):
    """A fixture body: torch (and so the C kernels, which take torch.get_num_threads()) on `n` threads, restored
    after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def other_vector_width(monkeypatch):
    """The kernels built for the vector width this machine does not pick (-DVW=16 on AVX2, -DVW=8 on AVX-512:
    GCC's vector extensions split or keep the vectors), so that both widths' code (tile shapes, panel width,
    the transposing sums) runs here; the packs and repacks made for it kept apart."""
    require_library()
    width = 8 if cpu._kernel.panel == 16 else 16
    lib = cpu._build((f"-DVW={width}",))
    assert lib.panel == width
    monkeypatch.setattr(cpu, "_kernel", lib)
    monkeypatch.setattr(cpu, "_packs", {})
    monkeypatch.setattr(cpu, "_gated_packs", {})
    monkeypatch.setattr(cpu, "_repacks", {})   # its groups of weight rows are QW of that width's
    monkeypatch.setattr(cpu, "_prepacks", {})  # its panels are that width's
    return width


# The decode attention's shapes: (query heads, KV heads, head size, block size, contexts, query scale).
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
