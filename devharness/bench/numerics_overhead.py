"""`devharness bench debug-overhead --part numerics`: what the numerics check (`--numerics-check`) costs.

Two engines of the same layout (the command's --model, --tp, --pp, --executor), one with the check and one without,
side by side in one run: (1) the workload (--num-requests x --output-len tokens) through each, rounds in turns, the
median of per-round tokens/s ratios; (2) decode steps at --decode-batch, the two engines' steps by turns, timed at the
driver: the median difference of neighbouring steps and its 95% interval, as a share of a step."""
from __future__ import annotations

import statistics
import time


def measure(args, prompts, median_ci) -> list[list[str]]:
    """The rows of docs/benchmarks.md's table. `prompts(args, seed)`: a round's prompts; `median_ci(xs)`: a median and
    its bootstrap 95% interval."""
    from devharness import LLM, SamplingParams
    from devharness.bench.executor import ray_for, start_decoding
    from devharness.engine.args import EngineArgs
    kw = EngineArgs.from_cli_args(args).kwargs()
    kw["max_concurrent_batches"] = 1   # each engine.step timed here runs one whole step
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    tokens_per_s: dict[bool, list[float]] = {False: [], True: []}
    diffs, step_us = [], []
    world = args.tp * args.pp
    with ray_for(2 * world, args.executor == "ray", args.ray_address), \
            LLM(**{**kw, "numerics_check": False}) as off, LLM(**{**kw, "numerics_check": True}) as on:
        engines = {False: off, True: on}
        for llm in engines.values():   # warm-up
            llm.generate(prompts(args, seed=-1)[:4], params)
        for r in range(args.rounds):
            round_prompts = prompts(args, seed=3000 + r)
            for check in ((False, True) if r % 2 == 0 else (True, False)):
                engines[check].reset_prefix_cache()
                t0 = time.perf_counter()
                engines[check].generate(round_prompts, params)
                tokens_per_s[check].append(args.num_requests * args.output_len / (time.perf_counter() - t0))
            for llm in engines.values():
                start_decoding(llm.engine, args.decode_batch, args.prompt_len, args.ab_steps // 2 + 8, seed=4000 + r)
            last_off = None
            for i in range(args.ab_steps):   # off, on, off, on ...: each "on" step against the "off" before it
                engine = engines[bool(i % 2)].engine
                t0 = time.perf_counter()
                engine.step()
                us = (time.perf_counter() - t0) * 1e6
                step_us.append(us)
                if i % 2:
                    diffs.append(us - last_off)
                else:
                    last_off = us
            for llm in engines.values():
                llm.engine.abort_all_requests()
    ratio = statistics.median(x / b for x, b in zip(tokens_per_s[True], tokens_per_s[False]))
    step = statistics.median(step_us)
    mid, lo, hi = (x / step * 100 for x in median_ci(diffs))
    layout = f"{args.model}, tp={args.tp} pp={args.pp}, {args.executor}"
    print(f"\nnumerics check ({layout}; {args.num_requests} requests x {args.output_len} tokens, {args.rounds} rounds "
          f"in turns):")
    for check, xs in tokens_per_s.items():
        print(f"  {'on' if check else 'off':<4}{statistics.median(xs):10.1f} tokens/s "
              f"(min {min(xs):.1f}, max {max(xs):.1f})")
    print(f"  with the check: {ratio:.3f}x without (median of per-round ratios; cost {(1 - ratio) * 100:+.1f}%)")
    print(f"  decode steps at batch {args.decode_batch}, on / off by turns: {mid:+.2f}% of a {step / 1000:.2f} ms step "
          f"(95% CI {lo:+.2f}% to {hi:+.2f}%; {len(diffs)} pairs); on by default in debug mode only if <= 3%: "
          f"{'met' if mid <= 3 else 'NOT met'}")
    return [[f"numerics check, on / off side by side: {layout}",
             f"{ratio:.3f}× tokens/s ({args.rounds} rounds); decode step at batch {args.decode_batch} {mid:+.2f}% "
             f"(95% CI {lo:+.2f}% to {hi:+.2f}%) of {step / 1000:.1f} ms", "≤ 3%"]]
