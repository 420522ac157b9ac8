"""`devharness bench timeline`: where a decode step's time goes, read from the timeline `devharness trace` reads (the
ranks' step histories and ledgers, the driver's steps): at tp=1, tp=2 (SmolLM2: 3) and pp=2 with one and two batches in flight,
per model. Each case decodes `--decode-batch` requests per batch (twice as many requests with two batches in flight,
so every batch holds as many rows) for TOKENS tokens; the answers are over its decode steps. Per model, two batches in
flight against one at pp=2: the tokens/s ratio next to the ratio of the stages' busy fractions (a stage that idles
half the time runs half as fast) and their bubbles. `--slow-ms N` plants `slow:ms=N` in every case (every rank
computes N ms longer at its stage's first layer, on the wall clock): a stage's forward then outweighs a step's
turnaround and the machine's load. Then how long `trace` takes for 64 steps of tp=2 x pp=2: reading the ranks from
the driver, and writing the file.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from devharness.bench.executor import positive_int
from devharness.bench.markdown import Table, add_flag, print_section, ratio
from devharness.fault_spec import parse

TOKENS = 24          # two batches in flight: 2 x 24 decode steps, within the 64 a rank's history holds
TRACE_STEPS = 64
PHASES = ("prepare", "forward", "collective", "send", "recv", "sample")
ONE, TWO = "pp=2, 1 batch in flight", "pp=2, 2 batches in flight"


def cases(model: str) -> dict[str, dict]:
    """tp=1, the smallest tp above 1 the model splits into (2, or SmolLM2's 3: 9 heads), pp=2 with 1 and 2 batches."""
    from devharness.model.loader import resolve_model
    a = resolve_model(model).arch
    heads, kv = a.num_attention_heads, a.num_key_value_heads
    tp = next(t for t in range(2, heads + 1) if heads % t == 0 and (kv % t == 0 or t % kv == 0)
              and a.intermediate_size % t == 0)   # LLMEngine's rule
    return {"tp=1": dict(tensor_parallel_size=1, pipeline_parallel_size=1, max_concurrent_batches=1),
            f"tp={tp}": dict(tensor_parallel_size=tp, pipeline_parallel_size=1, max_concurrent_batches=1),
            ONE: dict(tensor_parallel_size=1, pipeline_parallel_size=2, max_concurrent_batches=1),
            TWO: dict(tensor_parallel_size=1, pipeline_parallel_size=2, max_concurrent_batches=2)}


def slow_ms(text: str) -> float:
    """An argparse type: the ms of a `slow:ms=N` fault spec."""
    try:
        return parse(f"slow:ms={text}", "--slow-ms").ms
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--slow-ms: ")) from None


def register(sub) -> None:
    p = sub.add_parser("timeline", help="where a decode step's time goes at tp=1, tp=2 and pp=2 (from the timeline); "
                                        "how long trace takes")
    p.set_defaults(func=run)
    p.add_argument("--models", nargs="+", default=["tiny-llama", "smollm2"], metavar="M",
                   help="the models to measure, one after another")
    p.add_argument("--decode-batch", type=positive_int, default=8, help="requests per batch")
    p.add_argument("--slow-ms", type=slow_ms, default=None, metavar="N",
                   help="plant slow:ms=N in every case: every rank computes N ms longer at its stage's first layer")
    add_flag(p)


def _decode(llm, requests: int) -> tuple[float, dict, float]:
    """tokens/s of `requests` greedy requests; the timeline's answers over their decode steps; the driver's own time
    per step (scheduling and applying the output, ms, median)."""
    from devharness import SamplingParams
    from devharness.monitor import trace
    from devharness.diagnostics import timeline
    engine = llm.engine
    before = max((d.step for d in engine.driver_timeline().steps), default=0)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 250 + 1 for j in range(8)]} for i in range(requests)]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    tokens_per_s = requests * TOKENS / (time.perf_counter() - t0)
    src = trace.read_engine(engine)
    mcb = engine.config.parallel.batches_in_flight
    # The run's steps, less its prefill steps (one per batch) at the start.
    decode = [s.step for s in src.histories[0] if s.step > before + mcb]
    ans = timeline.answers(src.ledgers, src.histories, len(decode))
    own = [(d.sent - d.scheduled + d.applied - d.done) * 1000 for d in src.driver.steps
           if d.step in set(decode) and d.applied is not None]
    return tokens_per_s, ans, statistics.median(own) if own else float("nan")


def _trace_cost() -> tuple[float, float, int]:
    """tp=2 x pp=2 tiny-llama after 64+ decode steps: seconds to read its ranks from the driver and to write the
    trace of the last 64 steps (medians of 3), and the file's bytes."""
    from devharness import LLM, SamplingParams
    from devharness.monitor import trace
    with LLM("tiny-llama", tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="mp",
             threads_per_worker=1, num_kv_blocks=128, max_concurrent_batches=1) as llm, \
            tempfile.TemporaryDirectory() as tmp:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 4,
                     SamplingParams(max_tokens=TRACE_STEPS + 4, temperature=0, ignore_eos=True))
        reads, writes = [], []
        out = Path(tmp) / "trace.json"
        for _ in range(3):
            t0 = time.perf_counter()
            src = trace.read_engine(llm.engine)
            t1 = time.perf_counter()
            trace.write(src, out, TRACE_STEPS)
            reads.append(t1 - t0)
            writes.append(time.perf_counter() - t1)
        return statistics.median(reads), statistics.median(writes), out.stat().st_size


def run(args) -> int:
    from devharness import LLM
    rows, overlap = [], []
    inject = f"slow:ms={args.slow_ms:g}" if args.slow_ms else None
    for model in args.models:
        got = {}
        for name, case in cases(model).items():
            requests = args.decode_batch * case["max_concurrent_batches"]
            with LLM(model, distributed_executor_backend="uni" if name == "tp=1" else "mp", threads_per_worker=1,
                     num_kv_blocks=requests * 4, max_num_seqs=requests, inject=inject, **case) as llm:
                llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 2)   # warm-up
                tokens_per_s, ans, own_ms = _decode(llm, requests)
            got[name] = tokens_per_s, ans
            rows.append(_row(model, name, tokens_per_s, ans, own_ms))
            print(f"{model}, {name}: {tokens_per_s:.1f} tokens/s, {ans['steps']} decode steps", flush=True)
        overlap.append(_overlap_line(model, got[ONE], got[TWO]))
    header = ["model, case", "tokens/s", "rank's step (ms)", "driver's own (ms)",
              *[f"{p}" for p in PHASES], "bubble per stage"]
    table = Table(header, rows, "l" + "r" * (len(header) - 1))
    print("\n" + "\n".join(table.lines()))
    print("\n" + "\n".join(overlap))
    read_s, write_s, size = _trace_cost()
    line = (f"trace of {TRACE_STEPS} steps, tiny-llama tp=2 x pp=2 (4 ranks): reading the ranks {read_s * 1000:.0f} ms, "
            f"writing the file {write_s * 1000:.0f} ms ({size / 1e6:.1f} MB)")
    print("\n" + line)
    if args.markdown:
        print_section([table, "\n".join(overlap), line],
                      note=f"1 torch thread per worker, batches of {args.decode_batch} requests, {TOKENS} tokens"
                           + (f", {inject} (every rank)" if inject else ""))
    return 0


def _row(model: str, name: str, tokens_per_s: float, ans: dict, own_ms: float) -> list[str]:
    share = ans["step_breakdown"]
    stages = ", ".join(f"{s['bubble_fraction']:.0%}" for s in ans["stages"])
    return [f"{model}, {name}", f"{tokens_per_s:.1f}", f"{ans['step_ms_p50']:.1f}", f"{own_ms:.2f}",
            *[f"{share[p]:.0%}" if p in share else "" for p in PHASES], stages]


def _overlap_line(model: str, one: tuple[float, dict], two: tuple[float, dict]) -> str:
    """Two batches in flight against one at pp=2: tokens/s and the stages' mean busy fraction, each as a ratio (the
    one follows the other where the stages' compute is what limits the pipeline), and each stage's bubble."""
    busy = lambda ans: statistics.fmean(s["busy_fraction"] for s in ans["stages"])
    bubbles = lambda ans: ", ".join(f"{s['bubble_fraction']:.0%}" for s in ans["stages"])
    return (f"{model}, pp=2, 2 batches in flight against 1: tokens/s {ratio(two[0] / one[0])}, busy fraction "
            f"{ratio(busy(two[1]) / busy(one[1]))} (bubble per stage {bubbles(one[1])} -> {bubbles(two[1])})")
