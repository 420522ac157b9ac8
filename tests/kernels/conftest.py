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
    the transposing sums) runs here; the packs made for it kept apart."""
    require_library()
    width = 8 if cpu._kernel.panel == 16 else 16
    lib = cpu._build((f"-DVW={width}",))
    assert lib.panel == width
    monkeypatch.setattr(cpu, "_kernel", lib)
    monkeypatch.setattr(cpu, "_packs", {})
    monkeypatch.setattr(cpu, "_gated_packs", {})
    return width
