"""`devharness bench kernels`: every op of the kernel registry (devharness.kernels.OPS) on the shapes a model runs
it at, its custom kernel against the best of its library forms, side by side in one run. Per op, the custom
kernel is chosen where it is faster than the library form the engine would run instead (the op's reference) over
the op's shapes, each counted as often as a forward calls it, by their fastest samples (see Choice); `--save`
writes the choices where `kernels_for("fast")` reads them on this machine (kernels.choices_path()).

Random float32 tensors of the model's shapes on the CPU: no weights are loaded. The library forms are each op's
reference and, for the linear ops, `torch.mm(weight, x.t())` (BLAS streams the weight against a skinny
right-hand side, at a rate that differs from F.linear's for few rows); the custom kernel is
`torch.ops.devharness.<op>`, what the engine calls. Every weight comes in distinct copies that together hold as
many bytes as the model's weights (up to twice the last-level cache; at most 64 copies and 512 MiB), packed before
timing where the custom kernel packs (packing is not timed), and each call takes the next copy: the weights come
from memory where a step's do, not from the cache. The decode attention's block tables likewise draw from as many
blocks as its rows' contexts fill in every layer.

A sample is a few calls of one form (at least ~2 ms of them); the forms take turns sample by sample in a rotating
order, so that load from other tenants of the machine hits them alike. The table gives each form's median and
fastest sample, per call.
"""
from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Callable

from devharness.bench.executor import positive_int
from devharness.bench.markdown import Table, add_flag, cpu_name, print_section, ratio

BLOCK_SIZE = 16
MAX_COPIES = 64
MAX_BYTES = 512 << 20    # the most one shape's weight copies (or the paged cache) hold
SAMPLE_S = 2e-3          # a sample's calls take at least this long (where one call is shorter)
SAMPLE_CAP_S = 40e-3     # a sample stalled by other processes ends after this long, with the calls it made
MAX_CALLS = 256          # calls per sample at most
TABLE_COPIES = 8         # block tables / slot mappings per case, each call the next


def register(sub) -> None:
    p = sub.add_parser("kernels", help="each op's custom kernel against its best library form, on a model's shapes")
    p.set_defaults(func=run)
    from devharness.engine.args import add_option_flags
    add_option_flags(p, ["model"], defaults={"model": "smollm2"}, notes={
        "model": "here: whose shapes (no weights are read), default smollm2, tiny-llama for a quick run"})
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 32, 128, 512], metavar="N",
                   help="rows per call: decode batches (1 32 128) and a prefill chunk (512)")
    p.add_argument("--contexts", type=positive_int, nargs="+", default=[128, 1024], metavar="TOKENS",
                   help="context lengths of the decode attention's rows")
    p.add_argument("--repeats", type=positive_int, default=10, help="samples of each form per shape")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--save", action="store_true",
                   help="write each op's choice where the fast backend reads it on this machine")
    add_flag(p)


@dataclass
class Case:
    """One op at one shape: `make()` builds the argument tuples (one per copy; each call takes the next) when the
    case is timed, dropped after it. `calls`: how often a forward calls the op at this shape (the choice's
    weight)."""
    op: str
    shape: str
    rows: int
    calls: int
    make: Callable[[], list[tuple]]


# -- library forms other than the reference ------------------------------------------------------

def _mm_linear(x, weight, bias=None):
    import torch
    y = torch.mm(weight, x.t()).t().contiguous()
    return y if bias is None else y.add_(bias)


def _mm_gated_linear(x, weight, bias=None):
    import torch
    import torch.nn.functional as F
    h = torch.mm(weight, x.t())
    if bias is not None:
        h = h.add_(bias[:, None])
    gate, up = h.chunk(2, dim=0)
    return F.silu(gate).mul_(up).t().contiguous()


def _mm_linear_argmax(x, weight, num_valid):
    import torch
    return torch.mm(weight, x.t())[:num_valid].max(dim=0).indices


def _sdpa_causal_prefill(q, k, v, k_cache, v_cache, block_ids, context_len, scale):
    """SDPA's is_causal call (its flash kernel with no mask to read) where nothing was cached before the chunk, the
    reference's masked call elsewhere: the fastest library form. Not the reference: it gives a query holding a NaN a
    row of zeros."""
    import torch.nn.functional as F
    from devharness.kernels import reference
    if context_len != q.shape[0]:
        return reference.prefill_attention(q, k, v, k_cache, v_cache, block_ids, context_len, scale)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


MM, SDPA_CAUSAL = "w @ x^T", "SDPA is_causal"
EXTRA_FORMS = {"linear": {MM: _mm_linear}, "gated_linear": {MM: _mm_gated_linear},
               "linear_argmax": {MM: _mm_linear_argmax}, "prefill_attention": {SDPA_CAUSAL: _sdpa_causal_prefill}}


# -- the machine -----------------------------------------------------------------------------------

def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (sysfs), 32 MiB where it does not say."""
    from pathlib import Path
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * unit)
        except ValueError:
            continue
    return best or 32 << 20


# -- the cases -------------------------------------------------------------------------------------

def model_weight_bytes(arch) -> int:
    """The float32 bytes of the weights a forward multiplies: every layer's projections and the LM head."""
    from devharness.bench.flops import linear_shapes
    shapes = linear_shapes(arch)
    per_layer = sum(i * o for name, (i, o) in shapes.items() if name != "lm_head")
    return 4 * (arch.num_hidden_layers * per_layer + shapes["lm_head"][0] * shapes["lm_head"][1])


class Inputs:
    """Random tensors of a model's shapes, spread over as many bytes as a forward reads (up to twice the last-level
    cache, past which more changes nothing), so that they come from memory, or from the cache, as a step's do:
    each weight in distinct copies that together hold as many bytes as the model's weights (the last set kept for
    the next case of that weight), packed where the custom kernels pack; one paged KV cache, whose decode cases
    draw their block tables from as many blocks as their rows fill in every layer."""

    def __init__(self, arch, llc: int, packs: bool, rows: int, context: int):
        self.arch, self.packs = arch, packs
        self.span = 2 * llc
        self.weight_span = min(self.span, model_weight_bytes(arch))
        self.block_bytes = 2 * BLOCK_SIZE * arch.num_key_value_heads * arch.head_dim * 4
        needed = rows * -(-context // BLOCK_SIZE)
        self.cache_blocks = max(1, min(MAX_BYTES // self.block_bytes, self.blocks_for(needed)))
        self._weights: tuple[tuple, list] | None = None
        self._cache = None

    def copies(self, nbytes: int) -> int:
        return max(1, min(MAX_COPIES, -(-self.weight_span // nbytes), MAX_BYTES // nbytes))

    def blocks_for(self, needed: int) -> int:
        """The blocks a case of `needed` blocks a layer draws from: as many as every layer's (up to self.span)."""
        return max(needed, min(needed * self.arch.num_hidden_layers, -(-self.span // self.block_bytes)))

    def weights(self, out_features: int, in_features: int, gated: bool = False) -> list:
        """Distinct copies of a [out, in] weight, packed as the custom kernel would (gated: packed_gated_weight)."""
        import torch
        key = (out_features, in_features, gated)
        if self._weights is not None and self._weights[0] == key:
            return self._weights[1]
        self._weights = None   # the last set goes before this one is made
        first = torch.randn(out_features, in_features) * in_features ** -0.5
        ws = [first] + [first.clone() for _ in range(self.copies(first.numel() * 4) - 1)]
        if self.packs:
            from devharness.kernels import cpu
            for w in ws:
                cpu.packed_gated_weight(w) if gated else cpu.packed_weight(w)
        self._weights = (key, ws)
        return ws

    def qweights(self, out_features: int, in_features: int, qtype: str) -> list:
        """Distinct copies of a [out, in] weight in GGUF's `qtype` blocks (Q8_0, Q4_1), quantized by the gguf
        package, as a GGUF file ships them (uint8 [out, in / 32 * block bytes]), each with its repack made (as the
        engine's weights have theirs after the first decode step)."""
        import gguf
        import gguf.quants
        import numpy as np
        import torch
        key = (out_features, in_features, qtype)
        if self._weights is not None and self._weights[0] == key:
            return self._weights[1]
        self._weights = None
        w = np.random.default_rng(0).standard_normal((out_features, in_features)).astype(np.float32)
        first = torch.from_numpy(np.ascontiguousarray(
            gguf.quants.quantize(w * in_features ** -0.5, getattr(gguf.GGMLQuantizationType, qtype))))
        ws = [first] + [first.clone() for _ in range(self.copies(first.numel()) - 1)]
        if self.packs:   # the repack the custom kernel reads at decode's rows, made once as the engine's is
            from devharness.kernels import cpu
            for w in ws:
                cpu.q_repacked(w, int(getattr(gguf.GGMLQuantizationType, qtype)), in_features)
        self._weights = (key, ws)
        return ws

    def cache(self):
        """(k_cache, v_cache) [cache_blocks, BLOCK_SIZE, kv heads, head_dim], made on first use."""
        import torch
        if self._cache is None:
            shape = (self.cache_blocks, BLOCK_SIZE, self.arch.num_key_value_heads, self.arch.head_dim)
            self._cache = (torch.empty(shape).uniform_(-1, 1), torch.empty(shape).uniform_(-1, 1))
        return self._cache

    def drop(self, cache: bool = True) -> None:
        self._weights = None
        if cache:
            self._cache = None


def build_cases(arch, rows_list: list[int], contexts: list[int], inputs: Inputs) -> list[Case]:
    import torch
    from devharness.bench.flops import linear_shapes
    a, layers = arch, arch.num_hidden_layers
    h, heads, kv, d, vocab = a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.vocab_size
    qkv_width = (heads + 2 * kv) * d
    shapes = linear_shapes(arch)
    eps, scale = a.rms_norm_eps, d ** -0.5
    cases: list[Case] = []

    def add(op, shape, rows, calls, make):
        cases.append(Case(op, shape, rows, calls, make))

    def qkv(rows):   # q (rotated: its own tensor), k (rotated), v (a view of the projection's output), as the model
        t = torch.randn(rows, qkv_width)
        q, k, v = t.split([heads * d, kv * d, kv * d], dim=-1)
        return q.reshape(rows, heads, d).clone(), k.reshape(rows, kv, d).clone(), v.view(rows, kv, d)

    for name in ("qkv", "o", "down", "lm_head"):
        k_in, n_out = shapes[name]
        for rows in rows_list:
            add("linear", f"{name} {rows}x{k_in}->{n_out}", rows, 1 if name == "lm_head" else layers,
                lambda rows=rows, k_in=k_in, n_out=n_out:
                    [(x, w) for x in [torch.randn(rows, k_in)] for w in inputs.weights(n_out, k_in)])
    k_in, n_out = shapes["gate_up"]
    for rows in rows_list:
        add("gated_linear", f"gate_up {rows}x{k_in}->2x{n_out // 2}", rows, layers,
            lambda rows=rows, k_in=k_in, n_out=n_out:
                [(x, w) for x in [torch.randn(rows, k_in)] for w in inputs.weights(n_out, k_in, True)])
    k_in, n_out = shapes["lm_head"]
    for rows in rows_list:
        add("linear_argmax", f"lm_head {rows}x{k_in}->{n_out}", rows, 1,
            lambda rows=rows, k_in=k_in, n_out=n_out:
                [(x, w, vocab) for x in [torch.randn(rows, k_in)] for w in inputs.weights(n_out, k_in)])
    # The same products with the weights in GGUF's blocks (the types SmolLM2's file holds): its reference, the
    # library form, dequantizes them and runs the float op.
    from devharness.kernels.reference import Q4_1, Q8_0
    for name in ("qkv", "o", "down"):
        k_in, n_out = shapes[name]
        for rows in rows_list:
            add("q_linear", f"{name} {rows}x{k_in}->{n_out} Q4_1", rows, layers,
                lambda rows=rows, k_in=k_in, n_out=n_out:
                    [(x, w, Q4_1) for x in [torch.randn(rows, k_in)] for w in inputs.qweights(n_out, k_in, "Q4_1")])
    k_in, n_out = shapes["gate_up"]
    for rows in rows_list:
        add("q_gated_linear", f"gate_up {rows}x{k_in}->2x{n_out // 2} Q4_1", rows, layers,
            lambda rows=rows, k_in=k_in, n_out=n_out:
                [(x, w, Q4_1) for x in [torch.randn(rows, k_in)] for w in inputs.qweights(n_out, k_in, "Q4_1")])
    k_in, n_out = shapes["lm_head"]
    for rows in rows_list:
        add("q_linear_argmax", f"lm_head {rows}x{k_in}->{n_out} Q8_0", rows, 1,
            lambda rows=rows, k_in=k_in, n_out=n_out:
                [(x, w, Q8_0, vocab) for x in [torch.randn(rows, k_in)] for w in inputs.qweights(n_out, k_in, "Q8_0")])
        add("q_embedding", f"{rows} ids of {n_out}x{k_in} Q8_0", rows, 1,
            lambda rows=rows, k_in=k_in, n_out=n_out:
                [(torch.randint(0, vocab, (rows,)), w, Q8_0) for w in inputs.qweights(n_out, k_in, "Q8_0")])
    for rows in rows_list:
        add("argmax", f"{rows}x{vocab}", rows, 1, lambda rows=rows: [(torch.randn(rows, vocab),)])
    for rows in rows_list:
        add("rms_norm", f"{rows}x{h}", rows, 1, lambda rows=rows: [(torch.randn(rows, h), torch.randn(h), eps)])
    for rows in rows_list:
        add("add_rms_norm", f"{rows}x{h}", rows, 2 * layers,
            lambda rows=rows: [(torch.randn(rows, h), torch.randn(rows, h), torch.randn(h), eps)])
    for rows in rows_list:
        def rotate_args(rows=rows):
            q = torch.randn(rows, qkv_width)[:, :heads * d].view(rows, heads, d)   # a view of qkv, as the model's
            angles = torch.rand(rows, 1, d)
            return [(q, angles.cos(), angles.sin())]
        add("rotate", f"q {rows}x{heads}x{d} of qkv {rows}x{qkv_width}", rows, 2 * layers, rotate_args)
    inter = a.intermediate_size
    for rows in rows_list:
        add("silu_and_mul", f"{rows}x{2 * inter}->{inter}", rows, layers,
            lambda rows=rows: [(torch.randn(rows, 2 * inter),)])
    for rows in rows_list:
        def write_args(rows=rows):
            k_cache, v_cache = inputs.cache()
            _, k, v = qkv(rows)
            k = k.contiguous()
            slots = k_cache.shape[0] * BLOCK_SIZE
            return [(k_cache, v_cache, torch.randperm(slots)[:rows] if rows <= slots else
                     torch.randint(0, slots, (rows,)), k, v) for _ in range(TABLE_COPIES)]
        add("write_kv", f"{rows}x{kv}x{d}", rows, layers, write_args)
    def decode_args(rows, ctx):
        k_cache, v_cache = inputs.cache()
        width = -(-ctx // BLOCK_SIZE)
        blocks = min(k_cache.shape[0], inputs.blocks_for(rows * width))
        lens = torch.full((rows,), ctx, dtype=torch.int64)
        q = torch.randn(rows, heads, d)
        out = []
        for _ in range(TABLE_COPIES):
            table = torch.randperm(blocks)[:rows * width] if rows * width <= blocks else \
                torch.randint(0, blocks, (rows * width,))
            out.append((q, k_cache, v_cache, table.view(rows, width), lens, scale))
        return out

    def step_args(rows, ctx):   # paged_decode's, each row's last token at its slot, q, k and v not yet rotated
        out = []
        for q, k_cache, v_cache, table, lens, _ in decode_args(rows, ctx):
            _, k, v = qkv(rows)
            slots = table[:, (ctx - 1) // BLOCK_SIZE] * BLOCK_SIZE + (ctx - 1) % BLOCK_SIZE
            angles = torch.rand(rows, 1, d)
            out.append((q, k, v, angles.cos(), angles.sin(), k_cache, v_cache, slots, table, lens, scale))
        return out

    for op, make in (("paged_decode", decode_args), ("decode_attention", step_args)):
        for ctx in contexts:
            for rows in rows_list:
                add(op, f"{rows}x{heads}x{d} ctx {ctx}", rows, layers,
                    lambda rows=rows, ctx=ctx, make=make: make(rows, ctx))
    for rows in rows_list:
        def prefill_args(rows=rows):
            k_cache, v_cache = inputs.cache()
            q, k, v = qkv(rows)
            block_ids = torch.arange(-(-rows // BLOCK_SIZE)) % k_cache.shape[0]
            return [(q, k, v, k_cache, v_cache, block_ids, rows, scale)]
        add("prefill_attention", f"chunk {rows}x{heads}x{d}", rows, layers, prefill_args)
    return cases


# -- timing ----------------------------------------------------------------------------------------

def time_forms(forms: dict[str, Callable], args: list[tuple], repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each form: `repeats` samples each, the forms taking turns in a rotating order; a
    sample is `calls` calls (the same for every form), each on the next of `args` (each form from its own place
    in them, so that no form finds the copy another has just read in the cache)."""
    names = list(forms)
    n = len(args)
    place = {name: i * n // len(names) for i, name in enumerate(names)}

    def sample(name: str, calls: int) -> float:
        fn, i, done = forms[name], place[name], 0
        t0 = time.perf_counter()
        while True:
            fn(*args[i])
            i, done = (i + 1 if i + 1 < n else 0), done + 1
            elapsed = time.perf_counter() - t0
            if done == calls or elapsed > SAMPLE_CAP_S:
                break
        place[name] = i
        return elapsed / done

    probe = min(sample(name, 1) for name in names)   # warm-up: first-call allocations and set-up
    if probe < SAMPLE_S:
        probe = min(sample(name, 1) for name in names)
    calls = max(1, min(MAX_CALLS, round(SAMPLE_S / probe)))
    if calls > 1:   # short calls: a whole untimed round first, so that every form's caches and threads are warm
        for name in names:
            sample(name, calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(sample(name, calls))
    return times


@dataclass
class Row:
    op: str
    shape: str
    rows: int
    calls: int
    library_form: str        # the library form of the lowest median
    library_ms: float        # its median, per call
    library_min_ms: float    # its fastest sample, per call
    reference_min_ms: float  # the reference's fastest sample (the library form the engine runs)
    best_min_ms: float       # the fastest sample of any library form
    custom_ms: float | None
    custom_min_ms: float | None

    @property
    def speedup(self) -> float | None:
        return None if self.custom_ms is None else self.library_ms / self.custom_ms


def measure(case: Case, custom: Callable | None, repeats: int) -> Row:
    import torch
    from devharness.kernels import OPS
    forms = {"reference": OPS[case.op].reference, **EXTRA_FORMS.get(case.op, {})}
    if custom is not None:
        forms["custom"] = custom
    args = case.make()
    gc.disable()
    try:
        with torch.inference_mode():
            times = time_forms(forms, args, repeats)
    finally:
        gc.enable()
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    low = {name: min(ts) * 1e3 for name, ts in times.items()}
    library = [name for name in forms if name != "custom"]
    best = min(library, key=med.__getitem__)
    return Row(case.op, case.shape, case.rows, case.calls, best, med[best], low[best], low["reference"],
               min(low[name] for name in library), med.get("custom"), low.get("custom"))


@dataclass
class Choice:
    """An op's choice, by the fastest samples (which other tenants of the machine cannot slow down: a median
    moves with them, by ~8 ms a sample where one holds a core an OpenMP region waits for) of its shapes, each
    counted as often as a forward calls it."""
    op: str
    choice: str
    custom_ms: float | None    # the custom kernel's
    library_ms: float          # the library form's the engine runs (the reference)
    best_library_ms: float     # each shape's fastest library form's
    note: str = ""


def choose(op: str, rows: list[Row], custom: bool, built: bool) -> Choice:
    """The custom kernel up to the row count that makes the op's shapes least time in all (each counted as often as
    a forward calls it), the library form above: "custom" (at every row count measured, and beyond), "library",
    or "custom<=N" (a kernel may win at decode's few rows and lose at a prefill chunk's many)."""
    lib = sum(r.reference_min_ms * r.calls for r in rows)
    best = sum(r.best_min_ms * r.calls for r in rows)
    if not custom:
        return Choice(op, "library", None, lib, best, "library only")
    if not built:
        return Choice(op, "library", None, lib, best, "custom kernels not built here")
    cus = sum(r.custom_min_ms * r.calls for r in rows)
    counts = sorted({r.rows for r in rows})

    def total(limit: int) -> float:   # custom up to `limit` rows, the library above
        return sum((r.custom_min_ms if r.rows <= limit else r.reference_min_ms) * r.calls for r in rows)

    limit = min([0, *counts], key=lambda n: (total(n), -n))   # ties: the custom kernel further
    choice = "library" if limit == 0 else "custom" if limit == counts[-1] else f"custom<={limit}"
    return Choice(op, choice, cus, lib, best,
                  "" if choice in ("custom", "library") else f"custom up to {limit} rows, the library above: "
                                                             f"{_ms(total(limit))} ms")


# -- output ----------------------------------------------------------------------------------------

def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


HEAD = ("op", "shape", "library best", "median ms", "min ms", "custom ms", "min ms", "speedup")


def text_row(r: Row, custom_op: bool) -> str:
    head = f"{r.op:<18} {r.shape:<34} {r.library_form:<10} {_ms(r.library_ms):>10} {_ms(r.library_min_ms):>10}"
    if r.custom_ms is None:
        return f"{head}   {'library only' if not custom_op else 'not built'}"
    return f"{head} {_ms(r.custom_ms):>10} {_ms(r.custom_min_ms):>10} {r.speedup:>8.2f}x"


def text_choice(c: Choice) -> str:
    if c.custom_ms is None:
        return f"  chosen: {c.choice} ({c.note})"
    return (f"  chosen: {c.choice} (fastest samples, each shape x its calls in a forward: custom {_ms(c.custom_ms)} "
            f"ms, library {_ms(c.library_ms)} ms; each shape's best library form {_ms(c.best_library_ms)} ms"
            + (f"; {c.note})" if c.note else ")"))


def row_label(r: Row) -> str:
    """The words beside the op in docs/benchmarks.md's table: the projection (qkv, o, down, lm_head, gate_up; the
    quantized ones too), the
    argmax's width, the decode attention's context; none for the other ops."""
    if r.op in ("linear", "gated_linear", "linear_argmax", "q_linear", "q_gated_linear", "q_linear_argmax"):
        return r.shape.split()[0]
    if r.op == "argmax":
        return "rows × " + r.shape.split("x", 1)[1]
    if r.op in ("paged_decode", "decode_attention"):
        return "context " + r.shape.rsplit(" ", 1)[1]
    return ""


def choice_words(choice: str) -> str:
    """A choice as the docs' choices table says it: custom, library, or custom up to N rows, the library above."""
    from devharness.kernels import custom_max_rows
    limit = custom_max_rows(choice)
    return f"custom up to {limit} rows, the library above" if limit is not None else choice


def markdown_blocks(rows: list[Row], choices: list[Choice], saved: bool) -> list:
    """docs/benchmarks.md's tables: each op and shape's speedup (the library form's median / the custom kernel's) at
    each row count, then the ops grouped by what was chosen for them."""
    counts = sorted({r.rows for r in rows})
    lines: dict[tuple[str, str], dict[int, Row]] = {}
    for r in rows:
        lines.setdefault((r.op, row_label(r)), {})[r.rows] = r
    body = []
    for (op, label), by_rows in lines.items():
        name = f"`{op}`" + (f", {label}" if label else "")
        if all(r.custom_ms is None for r in by_rows.values()):
            why = next(c.note for c in choices if c.op == op) or "library only"
            body.append([name, why] + [""] * (len(counts) - 1))
        else:
            body.append([name] + [ratio(by_rows[n].speedup) if n in by_rows and by_rows[n].speedup is not None
                                  else "" for n in counts])
    groups: dict[str, list[str]] = {}
    for c in choices:
        groups.setdefault(c.choice, []).append(f"`{c.op}`")
    return [Table(["op, shape"] + [f"{n} row{'s' * (n != 1)}" for n in counts], body),
            "The choices `--save` wrote:" if saved else "The choices (`--save` writes them):",
            Table(["op", "runs"], [[", ".join(ops), choice_words(choice)] for choice, ops in groups.items()])]


def header(src, threads: int, inputs: Inputs, built) -> list[str]:
    a = src.arch
    load = ""
    if hasattr(os, "getloadavg"):   # other processes on the cores disturb the medians: say how many there were
        load = f", load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    lines = [f"CPU {cpu_name()}, torch threads {threads}{load}, {datetime.now():%Y-%m-%d %H:%M}, model {src.name} "
             f"(hidden {a.hidden_size}, {a.num_attention_heads}/{a.num_key_value_heads} heads of {a.head_dim}, "
             f"intermediate {a.intermediate_size}, vocab {a.vocab_size}, {a.num_hidden_layers} layers), float32",
             f"each weight in distinct copies, together {inputs.weight_span / 2**20:.1f} MiB (the model's weights, "
             f"up to 2x the {inputs.span / 2**21:.0f} MiB last-level cache), each call the next; times per call, "
             "median and min of the samples"]
    if built is None:
        lines.append("the custom kernels cannot be built here (no C compiler, or the build failed): only the "
                     "library forms are timed")
    else:
        lines.append(f"custom kernels: torch.ops.devharness.<op> (native.c, {built.panel}-float panels); speedup = "
                     "library best / custom")
    return lines


def run(args) -> int:
    import torch
    from devharness import kernels
    from devharness.kernels import cpu
    from devharness.model.loader import resolve_model
    src = resolve_model(args.model)   # a ValueError (an unknown model) is one line and exit 2
    before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, src, torch, kernels, cpu)
    finally:
        torch.set_num_threads(before)


def _run(args, src, torch, kernels, cpu) -> int:
    lib = cpu.library()
    registered = {}
    if lib is not None:
        from devharness.kernels import fast
        registered = fast.registered()
    arch, llc = src.arch, last_level_cache_bytes()
    inputs = Inputs(arch, llc, lib is not None, max(args.rows), max(args.contexts))
    threads = torch.get_num_threads()
    rows_list = sorted(set(args.rows))
    contexts = sorted(set(args.contexts))
    for line in header(src, threads, inputs, lib):
        print(line, flush=True)
    print()
    print(f"{HEAD[0]:<18} {HEAD[1]:<34} {HEAD[2]:<10} {HEAD[3]:>10} {HEAD[4]:>10} {HEAD[5]:>10} "
          f"{HEAD[6]:>10} {HEAD[7]:>9}", flush=True)
    cases = build_cases(arch, rows_list, contexts, inputs)
    table: list[Row] = []
    choices: list[Choice] = []
    for name, op in kernels.OPS.items():
        op_cases = [c for c in cases if c.op == name]
        if not op_cases:
            print(f"{name:<18} no shapes in bench/kernels.py", flush=True)
            continue
        custom = registered.get(name) if op.custom else None
        rows = []
        for case in op_cases:
            row = measure(case, custom, args.repeats)
            rows.append(row)
            print(text_row(row, op.custom), flush=True)
        choice = choose(name, rows, op.custom, lib is not None)
        choices.append(choice)
        table.extend(rows)
        print(text_choice(choice), flush=True)
        if name == "linear_argmax":
            inputs.drop(cache=False)   # the ops after it take no weights
    inputs.drop()
    saved = False
    if args.save:
        if lib is None:
            print("nothing saved: the custom kernels cannot be built here, so the fast backend runs the references")
        else:
            path = kernels.save_choices(
                {c.op: c.choice for c in choices}, cpu=cpu_name(), threads=threads,
                date=datetime.now().isoformat(timespec="seconds"), model=src.name, rows=rows_list, contexts=contexts,
                repeats=args.repeats, table=[{**vars(r), "speedup": r.speedup} for r in table])
            print(f"saved the choices to {path}")
            saved = True
    if args.markdown:
        print_section(markdown_blocks(table, choices, saved), note=f"model {src.name}")
    return 0
