"""Model FLOPs and the machine's matrix-multiply rate on the model's own shapes, for `bench throughput`.

A token's FLOPs are its matmuls (2 x the weights it multiplies: every layer's q/k/v, o, gate/up and
down projections; the LM head only for rows that are sampled) plus its attention (2 x 2 x context x
query heads x head size per layer: scores and the weighted sum). The matmul floor of a step is the time
the machine takes for the step's own matrix products alone, timed on random tensors of the same shapes
and dtype; a step's time over its floor says how much of it is anything but matmuls.
"""
from __future__ import annotations

import time

from devharness.model.arch import ModelArch


def linear_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of one layer, and of the LM head."""
    d = arch.head_dim
    return {"qkv": (arch.hidden_size, (arch.num_attention_heads + 2 * arch.num_key_value_heads) * d),
            "o": (arch.num_attention_heads * d, arch.hidden_size),
            "gate_up": (arch.hidden_size, 2 * arch.intermediate_size),
            "down": (arch.intermediate_size, arch.hidden_size),
            "lm_head": (arch.hidden_size, arch.vocab_size)}


def layer_matmul_flops(arch: ModelArch) -> int:
    """FLOPs per token of one layer's projections."""
    return sum(2 * i * o for name, (i, o) in linear_shapes(arch).items() if name != "lm_head")


def attention_flops(arch: ModelArch, context_len: int) -> int:
    """FLOPs of one query token attending to `context_len` tokens, over all layers."""
    return 4 * context_len * arch.num_attention_heads * arch.head_dim * arch.num_hidden_layers


def step_flops(arch: ModelArch, num_tokens: int, num_sampled: int, context_lens: list[int]) -> tuple[int, int]:
    """(matmul FLOPs, attention FLOPs) of a step: `num_tokens` rows through every layer, `num_sampled` rows
    through the LM head, and one query per entry of `context_lens` (each token's own context)."""
    i, o = linear_shapes(arch)["lm_head"]
    matmul = num_tokens * arch.num_hidden_layers * layer_matmul_flops(arch) + num_sampled * 2 * i * o
    return matmul, sum(attention_flops(arch, c) for c in context_lens)


def workload_flops(arch: ModelArch, workload: list[tuple[list[int], int]]) -> int:
    """Model FLOPs of generating each request's output after its prompt (prefill, then one decode per
    further token; the token at position p attends to p + 1 tokens). The LM head runs once per output token."""
    i, o = linear_shapes(arch)["lm_head"]
    per_token = arch.num_hidden_layers * layer_matmul_flops(arch)
    total = 0
    for prompt, n_out in workload:
        n_tokens = len(prompt) + n_out - 1   # the last output token is sampled, never fed back
        total += n_tokens * per_token + n_out * 2 * i * o
        total += 4 * arch.num_attention_heads * arch.head_dim * arch.num_hidden_layers * n_tokens * (n_tokens + 1) // 2
    return total


class MatmulFloor:
    """A step's matrix products alone, on random tensors of its shapes and dtype: `num_tokens` rows through every
    layer's projections, each layer with its own weights (as many bytes as the model's, so they come from memory
    as in a real step, not from a cache), then `num_sampled` rows through the LM head. Each projection may run in
    every form the engine may run it in: F.linear (BLAS), weight @ x^T (BLAS's rate differs between the two for
    few rows) and, where the native kernels are built and the engine would use them (float32), the C kernel over
    packed weights (packing not timed). best() times every form and keeps each projection's fastest; once() runs
    the products again in those forms, so that the floor can be timed beside each step it is the floor of."""

    def __init__(self, arch: ModelArch, num_tokens: int, num_sampled: int, dtype):
        import torch
        import torch.nn.functional as F
        from devharness.kernels import cpu
        self.forms = {"linear": lambda x, w: F.linear(x, w),
                      "weight @ x^T": lambda x, w: torch.mm(w, x.t()).t().contiguous()}
        self.products = {}
        for name, (i, o) in linear_shapes(arch).items():
            rows = num_sampled if name == "lm_head" else num_tokens
            copies = 1 if name == "lm_head" else arch.num_hidden_layers
            self.products[name] = (torch.randn(rows, i, dtype=dtype),
                                   [torch.randn(o, i, dtype=dtype) for _ in range(copies)])
        if dtype == torch.float32 and cpu.library() is not None:
            packs = {id(w): cpu.packed_weight(w) for _, ws in self.products.values() for w in ws}
            self.forms["native packed"] = lambda x, w: cpu.packed_linear(x, packs[id(w)], w.shape[0])
        self.flops = sum(2 * x.shape[0] * w.shape[0] * w.shape[1] for x, ws in self.products.values() for w in ws)
        self.fastest: dict[str, str] | None = None   # each projection's fastest form, once best() has run

    def best(self, repeats: int = 5) -> tuple[float, float]:
        """(seconds, GFLOP/s): the sum over the projections of the fastest of `repeats` runs in its fastest form:
        the best this machine does on these shapes, whichever form the engine uses."""
        import torch
        best = {(name, form): float("inf") for name in self.products for form in self.forms}
        with torch.inference_mode():
            for _ in range(repeats + 1):   # the first run warms up (allocations, kernel selection)
                for form, fn in self.forms.items():
                    for name, (x, ws) in self.products.items():
                        t0 = time.perf_counter()
                        for w in ws:
                            fn(x, w)
                        best[name, form] = min(best[name, form], time.perf_counter() - t0)
        self.fastest = {name: min(self.forms, key=lambda form: best[name, form]) for name in self.products}
        floor = sum(best[name, self.fastest[name]] for name in self.products)
        return floor, self.flops / floor / 1e9

    def once(self) -> float:
        """Seconds for the products run once more, each in the form best() found fastest."""
        import torch
        if self.fastest is None:
            raise RuntimeError("MatmulFloor.once() before best(): no form chosen yet")
        t0 = time.perf_counter()
        with torch.inference_mode():
            for name, (x, ws) in self.products.items():
                fn = self.forms[self.fastest[name]]
                for w in ws:
                    fn(x, w)
        return time.perf_counter() - t0


def matmul_floor_s(arch: ModelArch, num_tokens: int, num_sampled: int, dtype, repeats: int = 5) -> tuple[float, float]:
    """(seconds, GFLOP/s): MatmulFloor.best() for a step of these shapes."""
    return MatmulFloor(arch, num_tokens, num_sampled, dtype).best(repeats)
