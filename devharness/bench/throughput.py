"""`devharness bench throughput`: the engine against transformers' static-batch generate on one
workload, side by side in one run; the engine's decode step against a bare forward and against the
machine's matrix-multiply floor for its FLOPs, and the model-FLOPs utilisation (MFU) of both, measured
against the matmul rate on the model's own shapes in the same run (bench/flops.py).
With --pipeline (or --pp N, N >= 2): pp=N with 1 and N batches in flight against pp=1 on the same cores
(bench/pipeline.py). With --stories: the scheduler's side of a step with request stories on against off
(bench/stories.py)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from devharness.bench.executor import positive_int
from devharness.bench.markdown import Table, add_flag, print_section, ratio
from devharness.bench.workload import make_workload, run_engine


def register(sub) -> None:
    from devharness.engine.args import EngineArgs
    p = sub.add_parser("throughput", help="engine vs transformers tokens/s; engine step vs bare forward")
    EngineArgs.add_cli_args(p)
    from devharness.bench.pipeline import refuse_one_worker
    p.set_defaults(model="smollm2", func=run, precheck=refuse_one_worker)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    p.add_argument("--hf-batch-size", type=int, default=16, help="transformers' static batch size")
    p.add_argument("--decode-batch", type=int, default=32, help="batch size of the step-vs-forward comparison")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--pipeline", action="store_true",
                   help="instead: pp=N (--pp, at least 2) with 1 and N batches in flight against pp=1 on the same "
                        "cores; --pp N with N >= 2 implies it (--threads-per-worker: torch threads per pp worker, "
                        "default 1)")
    p.add_argument("--stories", action="store_true",
                   help="instead: the scheduler's side of each step with request stories on against off "
                        "(--no-request-stories), the same workload on both, and what the stories cost of a whole step")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="--pipeline: rounds of the three cases; --stories: rounds of on and off")
    add_flag(p)


def run_transformers(src, workload, batch_size: int) -> float:
    import torch
    import transformers
    from pathlib import Path
    if src.kind == "gguf":
        path = Path(src.path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  torch_dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(src.path, torch_dtype=torch.float32)
    model.eval()
    pad = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(workload), batch_size):
            chunk = workload[i:i + batch_size]
            width = max(len(p) for p, _ in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])       # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
            model.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in chunk), do_sample=False,
                           eos_token_id=None, pad_token_id=pad)
    return time.perf_counter() - t0


@dataclass
class StepTimes:
    """What step_vs_forward measured. Per timed step, in the order they ran: the step (ms), a bare forward (+ logits)
    on its inputs (ms), its matmul floor's products run once more (ms; `floor`, whose fastest forms were chosen before
    the steps) and its attention's FLOPs. Then the last step's inputs, and where one more step's time went: ms per
    kernel op (`devharness::<op>` and torch's own, as torch.profiler names them) and the step's wall ms."""
    steps: list[float]
    forwards: list[float]
    floors: list[float]
    attention_flops: list[int]
    floor: "MatmulFloor"
    inputs: object
    op_ms: dict[str, float]
    profiled_ms: float


@dataclass
class DecodeInputs:
    """What a decode step's forward ran on, as the model's forward pre-hook sees it. Every row of a decode step
    is a request's one new token, and each is sampled."""
    input_ids: object
    positions: object
    meta: object

    @property
    def sample_token_index(self):
        import torch
        decodes = sum(len(g.context_lens) for g in self.meta.decode_groups)
        if decodes != len(self.input_ids):   # a prefill chunk's rows are not each sampled
            raise RuntimeError(f"the step ran {len(self.input_ids)} rows, {decodes} of them decodes: not a decode step")
        return torch.arange(len(self.input_ids))


def step_vs_forward(llm, workload, batch: int, dtype, steps: int = 24) -> StepTimes:
    """Engine decode steps at `batch`, each beside a bare forward on its inputs (seen through torch's forward
    pre-hook on the model, which the uni executor hands out: Executor.model_in_process) and its matmul floor (timed
    apart first: MatmulFloor.best)."""
    import torch
    from devharness import SamplingParams
    from devharness.bench.flops import MatmulFloor
    engine = llm.engine
    model = engine.workers.model_in_process()
    captured = {}

    def capture(module, args):
        """torch's forward pre-hook: each forward's input ids, positions and attention metadata."""
        captured["inputs"] = DecodeInputs(*args[:3])

    hook = model.register_forward_pre_hook(capture)
    try:
        for p, _ in workload[:batch]:
            engine.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=10_000, temperature=0,
                                                                       ignore_eos=True))
        while not engine.scheduler_snapshot().all_decoding:
            engine.step()
        rows = engine.scheduler_snapshot().num_running   # every row decodes one token and samples it
        floor = MatmulFloor(engine.source.arch, rows, rows, dtype)
        floor.best()
        step_ms, fwd_ms, floor_ms, attn_flops = [], [], [], []
        with torch.inference_mode():
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                step_ms.append((time.perf_counter() - t0) * 1000)
                inp = captured["inputs"]
                t0 = time.perf_counter()
                hidden = model(inp.input_ids, inp.positions, inp.meta)
                model.compute_logits(hidden[inp.sample_token_index])
                fwd_ms.append((time.perf_counter() - t0) * 1000)
                floor_ms.append(floor.once() * 1000)
                attn_flops.append(_inputs_flops(engine.source.arch, inp)[1])
        op_ms, profiled_ms = profile_step(engine)
    finally:
        hook.remove()
        engine.abort_all_requests()
    return StepTimes(step_ms, fwd_ms, floor_ms, attn_flops, floor, captured["inputs"], op_ms, profiled_ms)


def profile_step(engine) -> tuple[dict[str, float], float]:
    """One engine step under torch.profiler: (ms per kernel op, slowest first: each devharness:: op's time with what
    it calls, and torch's top-level ops' beside them; the step's wall ms). The kernels are registered ops, so the
    profiler names them as it names aten's."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        engine.step()
        wall_ms = (time.perf_counter() - t0) * 1000
    ops: dict[str, float] = {}
    for event in prof.events():
        name = event.name
        if name.startswith("devharness::") or (name.startswith("aten::") and event.cpu_parent is None):
            ops[name] = ops.get(name, 0.0) + event.cpu_time_total / 1000
    return dict(sorted(ops.items(), key=lambda kv: -kv[1])), wall_ms


def _inputs_flops(arch, inp) -> tuple[int, int]:
    """flops.step_flops of the step these inputs (DecodeInputs) are for: its rows, its sampled rows, its contexts."""
    from devharness.bench.flops import step_flops
    contexts = [int(c) for g in inp.meta.decode_groups for c in g.context_lens]
    return step_flops(arch, len(inp.input_ids), len(inp.sample_token_index), contexts)


def run(args) -> int:
    from devharness import LLM
    from devharness.engine.args import EngineArgs
    if args.pipeline or args.pp > 1:
        from devharness.bench import pipeline
        return pipeline.run(args)
    if args.stories:
        from devharness.bench import stories
        return stories.run(args)
    import torch
    kw = EngineArgs.from_cli_args(args).kwargs()
    kw["distributed_executor_backend"] = "uni"
    with LLM(**kw) as llm:
        src = llm.engine.source
        arch, dtype = src.arch, getattr(torch, kw["dtype"])
        workload = make_workload(args, src.arch.vocab_size)
        n_out = sum(n for _, n in workload)
        print(f"model {src.name}, {len(workload)} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} "
              f"tokens, outputs {args.output_len[0]}-{args.output_len[1]} tokens ({n_out} in all), "
              f"{kw['dtype']}, torch threads {torch.get_num_threads()}, --kernels {kw['kernels']}")
        t0 = time.perf_counter()
        run_engine(llm, workload[:4])   # warm-up
        print(f"warm-up (4 requests): {time.perf_counter() - t0:.1f} s")
        engine_s = run_engine(llm, workload)
        print(f"devharness engine:          {n_out / engine_s:8.1f} tokens/s  ({engine_s:.1f} s)")
        invariant_s = _batch_invariant_side_by_side(kw, workload, n_out, engine_s)
        hf_s = ref_step = None
        if not args.skip_transformers:
            hf_s = run_transformers(src, workload, args.hf_batch_size)
            print(f"transformers (batch {args.hf_batch_size:3d}):  {n_out / hf_s:8.1f} tokens/s  ({hf_s:.1f} s)")
            print(f"ratio engine / transformers: {hf_s / engine_s:.2f}x")
        times = step_vs_forward(llm, workload, args.decode_batch, dtype)
        step, fwd = statistics.median(times.steps), statistics.median(times.forwards)
        print(f"decode step at batch {args.decode_batch}: engine {step:.2f} ms, bare forward {fwd:.2f} ms, "
              f"ratio {step / fwd:.3f}")
        top = list(times.op_ms.items())[:8]
        print(f"  where one step's time goes (torch.profiler, {times.profiled_ms:.2f} ms profiled): " +
              ", ".join(f"{name} {ms:.2f}" for name, ms in top) +
              f" ms; the rest (Python between the ops, inputs, scheduler) "
              f"{times.profiled_ms - sum(times.op_ms.values()):.2f} ms")
    if kw["kernels"] != "reference":
        # The same decode step with every op's reference, side by side: what the custom kernels win.
        with LLM(**{**kw, "kernels": "reference"}) as ref:
            run_engine(ref, workload[:4])
            ref_times = step_vs_forward(ref, workload, args.decode_batch, dtype)
        ref_step = statistics.median(ref_times.steps)
        print(f"decode step at batch {args.decode_batch} with --kernels reference: {ref_step:.2f} ms; "
              f"--kernels {kw['kernels']} takes {step / ref_step:.3f}x its time")
    paired = _report_flops(args, arch, dtype, workload, engine_s, times, kw["max_num_batched_tokens"])
    if args.markdown:
        print_section(markdown_blocks(args, n_out, engine_s, hf_s, times, ref_step, paired, invariant_s, kw["kernels"]),
                      note=f"{src.name}, {kw['dtype']}, uni executor, `--kernels {kw['kernels']}`")
    return 0


def markdown_blocks(args, n_out: int, engine_s: float, hf_s: float | None, times: StepTimes, ref_step: float | None,
                    paired: float, invariant_s: float | None, kernels: str = "fast") -> list:
    """docs/benchmarks.md's tables: tokens/s against transformers, the decode step against its bare forward, its
    reference kernels and its floor; where one step's time goes; --batch-invariant against the default where it ran."""
    step, fwd = statistics.median(times.steps), statistics.median(times.forwards)
    rows = [[f"engine, {args.num_requests} requests", f"{n_out / engine_s:.1f} tokens/s", ""]]
    if hf_s is not None:
        r = hf_s / engine_s
        rows += [[f"transformers `generate`, batches of {args.hf_batch_size}", f"{n_out / hf_s:.1f} tokens/s", ""],
                 ["**engine / transformers**", f"**{ratio(r)}**", f"≥ 4×: {'met' if r >= 4 else 'not met'}"]]
    rows += [[f"decode step, batch {args.decode_batch} (median)", f"{step:.1f} ms", ""],
             ["its bare forward", f"{fwd:.1f} ms", ""]]
    if ref_step is not None:
        rows.append(["the same step with `--kernels reference`",
                     f"{ref_step:.1f} ms: {kernels} takes {ratio(step / ref_step)} its time", ""])
    rows.append(["**step / the floor timed beside it** (paired median)", f"**{ratio(paired)}**",
                 f"≤ 1.5×: {'met' if paired <= 1.5 else 'not met'}"])
    ops = list(times.op_ms.items())[:7]
    where = (f"Where one step's time goes (torch.profiler, {times.profiled_ms:.1f} ms profiled): "
             + ", ".join(f"`{name.removeprefix('devharness::')}` {ms:.1f}" + (" ms" if i == 0 else "")
                         for i, (name, ms) in enumerate(ops))
             + f", the rest {times.profiled_ms - sum(ms for _, ms in ops):.1f}.")
    blocks = [Table(["", "figure", "target"], rows), where]
    if invariant_s is not None:
        blocks.append(Table(["", "figure"], [
            [f"default, {args.num_requests} requests", f"{n_out / engine_s:.1f} tokens/s"],
            ["`--batch-invariant`", f"{n_out / invariant_s:.1f} tokens/s"],
            ["**`--batch-invariant` time / default time**", f"**{ratio(invariant_s / engine_s)}**"]]))
    return blocks


def _batch_invariant_side_by_side(kw: dict, workload, n_out: int, engine_s: float) -> float | None:
    """The same workload with --batch-invariant (every op's custom kernel at every row count), where it runs other
    kernels than the engine just measured: its tokens/s and its time against the default's."""
    from devharness import LLM
    from devharness.kernels import kernels_for
    if kw.get("batch_invariant") or kw["kernels"] != "fast" or kw["device"] != "cpu" or kw["dtype"] != "float32":
        return None
    if kernels_for("fast").choices == kernels_for("fast", batch_invariant=True).choices:
        print("--batch-invariant: the same kernels here (no op's saved choice runs torch's form at any row count)")
        return None
    with LLM(**{**kw, "batch_invariant": True}) as llm:
        run_engine(llm, workload[:4])
        invariant_s = run_engine(llm, workload)
    print(f"--batch-invariant:          {n_out / invariant_s:8.1f} tokens/s  ({invariant_s:.1f} s): "
          f"{invariant_s / engine_s:.3f}x the default's time")
    return invariant_s


def _report_flops(args, arch, dtype, workload, engine_s: float, times: StepTimes, budget: int) -> float:
    """The matmul rate on the model's shapes and the MFU of the workload and of the decode step."""
    from devharness.bench import flops
    inp, step_ms, best_step_ms = times.inputs, statistics.median(times.steps), min(times.steps)
    n_tokens, n_sampled = len(inp.input_ids), len(inp.sample_token_index)
    step_matmul, step_attn = _inputs_flops(arch, inp)
    if (n_tokens, n_sampled) != tuple(times.floor.products[k][0].shape[0] for k in ("qkv", "lm_head")):
        raise RuntimeError(f"the timed step ran {n_tokens} rows ({n_sampled} sampled), not its floor's")
    floor_s, decode_rate = times.floor.best()
    # Prefill-sized products (256 rows, and a whole step's token budget): the best rate the machine reaches on
    # these shapes.
    _, prefill_rate = flops.matmul_floor_s(arch, 256, 256, dtype, repeats=2)
    _, budget_rate = flops.matmul_floor_s(arch, budget, budget, dtype, repeats=1)
    peak = max(decode_rate, prefill_rate, budget_rate)
    work = flops.workload_flops(arch, workload)
    print(f"matmul rate on the model's shapes: {decode_rate:.1f} GFLOP/s at {n_tokens} rows, "
          f"{prefill_rate:.1f} GFLOP/s at 256 rows, {budget_rate:.1f} GFLOP/s at {budget} rows (peak {peak:.1f})")
    print(f"workload: {work / 1e9:.0f} GFLOP in {engine_s:.1f} s = {work / engine_s / 1e9:.1f} GFLOP/s, "
          f"MFU {work / engine_s / 1e9 / peak:.1%} of the peak matmul rate")
    step_gflops = (step_matmul + step_attn) / (step_ms / 1000) / 1e9
    # The floor for the step's FLOPs: its matrix products timed on their own shapes, and its attention's FLOPs
    # (dot products over the cached keys and values) at the matmul rate of those shapes.
    attn_floor_s = step_attn / (decode_rate * 1e9)
    full_floor_s = floor_s + attn_floor_s
    print(f"decode step at batch {n_tokens}: {(step_matmul + step_attn) / 1e9:.2f} GFLOP "
          f"({step_attn / 1e9:.2f} of it attention) in {step_ms:.1f} ms = {step_gflops:.1f} GFLOP/s, "
          f"MFU {step_gflops / decode_rate:.1%} of the matmul rate at its shapes")
    print(f"  the matmul floor for its FLOPs: its matmuls {floor_s * 1000:.2f} ms + its attention's FLOPs at that rate "
          f"{attn_floor_s * 1000:.2f} ms = {full_floor_s * 1000:.2f} ms: step = {step_ms / 1000 / full_floor_s:.2f}x "
          f"the floor (target <= 1.5x; {step_ms / 1000 / floor_s:.2f}x its matmuls alone)")
    # The floor keeps each product's best of several tries; beside the median step, the best step (the same
    # statistic) says how much of the gap the machine's other load made.
    print(f"  the fastest of the steps: {best_step_ms:.2f} ms = {best_step_ms / 1000 / full_floor_s:.2f}x the floor")
    # Side by side: each step against its floor's products run right after it (the same forms), so that the
    # machine's other load at that moment weighs on both; the floor above is the best of its own runs instead.
    # Each step's attention FLOPs at the rate above: its contexts are a token longer than the last step's.
    paired = sorted(s / (f + a / decode_rate / 1e6) for s, f, a in zip(times.steps, times.floors, times.attention_flops))
    print(f"  paired, each step against its floor timed beside it: median {statistics.median(paired):.2f}x (target <= 1.5x) "
          f"(from {paired[0]:.2f}x to {paired[-1]:.2f}x over {len(paired)} steps; floors "
          f"{min(times.floors):.2f}-{max(times.floors):.2f} ms + {attn_floor_s * 1000:.2f} ms)")
    return statistics.median(paired)
