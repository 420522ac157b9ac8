"""`devharness bench throughput`'s arithmetic: the model FLOPs of a workload against those of the steps that run
it, and the bench itself at its smallest (tiny-llama, no transformers side): it runs, prints its figures, and its
floor for a decode step's FLOPs is its matmuls' floor plus its attention's FLOPs at the matmul rate."""
import re

from devharness.bench import flops
from devharness.cli import main
from devharness.model.builtin import TINY_ARCH


def test_a_workloads_flops_are_its_steps_flops():
    """Generating n tokens after a prompt of p: one prefill of p tokens (the first sampled), then n - 1 decodes
    of one token each; every token attends to the tokens up to itself. Summed from step_flops step by step."""
    arch = TINY_ARCH
    for prompt_len, n_out in [(5, 1), (7, 4), (33, 16)]:
        matmul, attn = flops.step_flops(arch, prompt_len, 1, [p + 1 for p in range(prompt_len)])
        total = matmul + attn
        for i in range(1, n_out):
            m, a = flops.step_flops(arch, 1, 1, [prompt_len + i])
            total += m + a
        assert flops.workload_flops(arch, [([0] * prompt_len, n_out)]) == total


def test_matmul_floor_times_its_products_in_their_fastest_forms():
    """best() picks each projection's fastest form; once() runs them all again in those forms (and only after)."""
    import pytest
    import torch
    floor = flops.MatmulFloor(TINY_ARCH, 3, 2, torch.float32)
    with pytest.raises(RuntimeError, match="before best"):
        floor.once()
    seconds, rate = floor.best(repeats=1)
    assert set(floor.fastest) == set(flops.linear_shapes(TINY_ARCH)) and set(floor.fastest.values()) <= set(floor.forms)
    assert seconds > 0 and rate > 0 and floor.once() > 0
    assert floor.products["lm_head"][0].shape[0] == 2 and floor.products["qkv"][0].shape[0] == 3
    assert len(floor.products["down"][1]) == TINY_ARCH.num_hidden_layers and len(floor.products["lm_head"][1]) == 1


def test_bench_throughput_runs_and_its_floor_adds_up(capsys):
    rc = main(["bench", "throughput", "--model", "tiny-llama", "--skip-transformers", "--num-requests", "6",
               "--prompt-len", "4", "8", "--output-len", "3", "6", "--decode-batch", "4", "--markdown"])
    out = capsys.readouterr().out
    assert rc == 0, out
    step = float(re.search(r"decode step at batch 4: engine (\d+\.\d+) ms", out)[1])
    m = re.search(r"its matmuls (\d+\.\d+) ms \+ its attention's FLOPs at that rate (\d+\.\d+) ms = (\d+\.\d+) ms: "
                  r"step = (\d+\.\d+)x the floor", out)
    assert m, out
    matmuls, attention, floor, ratio = map(float, m.groups())
    assert abs(matmuls + attention - floor) <= 0.011 and floor > 0, out
    # The printed figures are rounded (to 0.01 ms, the ratio to 0.01).
    assert abs(step / floor - ratio) <= ratio * (0.005 / step + 0.005 / floor) + 0.01, out
    assert re.search(r"workload: \d+ GFLOP in \d+\.\d+ s = \d+\.\d+ GFLOP/s, MFU \d+\.\d+%", out), out
    best = float(re.search(r"the fastest of the steps: (\d+\.\d+) ms", out)[1])
    assert 0 < best <= step + 0.005, out   # the fastest step is no slower than the median
    # Paired: each step over the floor timed right after it; the median lies in the printed range, whose low end no
    # step can go below: the fastest step over the slowest floor.
    paired = re.search(r"paired, each step against its floor timed beside it: median (\d+\.\d+)x \(target <= 1\.5x\) \(from (\d+\.\d+)x "
                       r"to (\d+\.\d+)x over (\d+) steps; floors (\d+\.\d+)-(\d+\.\d+) ms \+ (\d+\.\d+) ms\)", out)
    assert paired, out
    med, low, high, n, f_min, f_max, attn = map(float, paired.groups())
    assert n == 24 and low <= med <= high and 0 < f_min <= f_max, out
    assert low >= best / (f_max + attn + 0.01) - 0.01, out
    # Where one step's time goes, from torch.profiler: the kernels are registered ops, so the profiler names them
    # (devharness::<op>); their times and the rest add up to the profiled step.
    where = re.search(r"where one step's time goes \(torch\.profiler, (\d+\.\d+) ms profiled\): (.*) ms; "
                      r"the rest \(.*?\) (-?\d+\.\d+) ms", out)
    assert where, out
    profiled, rest = float(where[1]), float(where[3])
    ops = {k: float(v) for k, v in (p.rsplit(" ", 1) for p in where[2].split(", "))}
    assert "devharness::linear" in ops and "devharness::decode_attention" in ops, out   # a decode step: the fused op
    assert all(v >= 0 for v in ops.values()) and sum(ops.values()) <= profiled + 0.05, out
    assert rest >= -0.05, out
    # Beside it, the same decode step with every op's reference.
    ref = re.search(r"decode step at batch 4 with --kernels reference: (\d+\.\d+) ms; --kernels fast takes "
                    r"(\d+\.\d+)x its time", out)
    assert ref and float(ref[1]) > 0 and abs(step / float(ref[1]) - float(ref[2])) <= 0.01 + 0.01 * float(ref[2]), out
    # --markdown: docs/benchmarks.md's table and paragraph, the same figures as the text (rounded to 0.1).
    from devharness.bench.markdown import parse_table
    assert re.search(r"^.+, \d+ vCPUs, torch [\d.]+\w*, \d+ threads?, tiny-llama, float32, uni executor, `--kernels fast`; "
                     r"\d{4}-\d\d-\d\d\.$", out, re.M), out
    rows = {r[0]: r[1:] for r in parse_table(out, ["", "figure", "target"])}
    assert list(rows) == ["engine, 6 requests", "decode step, batch 4 (median)", "its bare forward",
                          "the same step with `--kernels reference`",
                          "**step / the floor timed beside it** (paired median)"], rows   # no transformers: skipped
    tokens_s = re.search(r"devharness engine:\s+(\d+\.\d) tokens/s", out)[1]
    assert rows["engine, 6 requests"] == [f"{tokens_s} tokens/s", ""], rows
    fwd = float(re.search(r"bare forward (\d+\.\d+) ms", out)[1])
    for name, value in (("decode step, batch 4 (median)", step), ("its bare forward", fwd)):
        assert abs(float(rows[name][0].removesuffix(" ms")) - value) <= 0.051, (name, rows, out)
    ref_ms, ref_ratio = re.fullmatch(r"(\d+\.\d) ms: fast takes (\d+\.\d\d)× its time",
                                     rows["the same step with `--kernels reference`"][0]).groups()
    assert abs(float(ref_ms) - float(ref[1])) <= 0.051 and abs(float(ref_ratio) - float(ref[2])) <= 0.0051, (rows, out)
    assert rows["**step / the floor timed beside it** (paired median)"] == [
        f"**{med:.2f}×**", f"≤ 1.5×: {'met' if med <= 1.5 else 'not met'}"], rows
    para = re.search(r"^Where one step's time goes \(torch\.profiler, (\d+\.\d) ms profiled\): `([\w:]+)` (\d+\.\d) ms, ", out, re.M)
    top = next(iter(ops.items()))
    assert para and abs(float(para[1]) - profiled) <= 0.051 and para[2] == top[0].removeprefix("devharness::") \
        and abs(float(para[3]) - top[1]) <= 0.051, (para, top, out)
