"""`devharness bench debug-overhead --part numerics`: what the numerics check (`--numerics-check`) costs, in the
command's layout (--model, --tp, --pp, --executor), side by side in one run:

(1) decode steps at --decode-batch of one engine, the check installed on odd steps and removed on even ones, on every
rank alike, each step's thread CPU time taken inside the workers (the "numerics-ab" profile, debug/profiler.py): the
median difference of neighbouring steps on the slowest rank and its 95% interval, as a share of a step timed at the
driver (as the worker state's figure). Neighbouring
steps of one engine share whatever load the machine has: the figure the default follows.
(2) the workload (--num-requests x --output-len tokens) through two engines, with and without the check, rounds in
turns: the median of per-round tokens/s ratios. Two engines side by side differ by a few percent on a busy machine
with the same settings: a coarse figure."""
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
    kw["max_concurrent_batches"] = 1   # each engine.step runs one whole step
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    tokens_per_s: dict[bool, list[float]] = {False: [], True: []}
    pairs: list[list[tuple[float, float]]] = []   # per round, per rank: (off, on) CPU us of neighbouring steps
    step_us: list[float] = []                      # the A/B's steps at the driver (wall time)
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
            engine = off.engine
            start_decoding(engine, args.decode_batch, args.prompt_len, args.ab_steps + 12, seed=4000 + r)
            engine.start_profile("numerics-ab")
            try:
                for _ in range(args.ab_steps + 2):
                    t0 = time.perf_counter()
                    engine.step()
                    step_us.append((time.perf_counter() - t0) * 1e6)
            finally:
                pairs.append([res.pairs_us for res in engine.stop_profile()])
            engine.abort_all_requests()
    ratio = statistics.median(x / b for x, b in zip(tokens_per_s[True], tokens_per_s[False]))
    # The CPU time a step of the slowest rank gains, as a share of a step at the driver (as the worker state's figure).
    step = statistics.median(step_us)
    worst = None
    for rank in range(world):
        rank_pairs = [p for round_pairs in pairs for p in round_pairs[rank]]
        cpu = statistics.median(off_us for off_us, _ in rank_pairs)
        diff = median_ci([on_us - off_us for off_us, on_us in rank_pairs])
        if worst is None or diff[0] > worst[0][0]:
            worst = (diff, cpu, len(rank_pairs))
    (us, lo_us, hi_us), cpu, n = worst
    mid, lo, hi = (x / step * 100 for x in (us, lo_us, hi_us))
    layout = f"{args.model}, tp={args.tp} pp={args.pp}, {args.executor}"
    print(f"\nnumerics check ({layout}):")
    share = us / cpu * 100
    print(f"  decode steps at batch {args.decode_batch}, installed / removed by turns inside the workers: {us:+.0f} us "
          f"of CPU time a step (95% CI {lo_us:+.0f} to {hi_us:+.0f}; {n} pairs; slowest rank, whose step takes "
          f"{cpu:.0f} us of CPU: {share:+.1f}% of it) = {mid:+.2f}% of a {step / 1000:.2f} ms step at the driver (CI "
          f"{lo:+.2f}% to {hi:+.2f}%); a debug-mode default only within 3% of both: "
          f"{'met' if max(mid, share) <= 3 else 'NOT met'}")
    for check, xs in tokens_per_s.items():
        print(f"  two engines, {'on' if check else 'off':<4}{statistics.median(xs):10.1f} tokens/s "
              f"(min {min(xs):.1f}, max {max(xs):.1f}; {args.num_requests} requests x {args.output_len} tokens)")
    print(f"  two engines: with the check {ratio:.3f}x without (median of {args.rounds} per-round ratios)")
    return [[f"numerics check, {layout}: decode step at batch {args.decode_batch}, installed / removed by turns",
             f"{us:+.0f} µs = {mid:+.2f}% (95% CI {lo:+.2f}% to {hi:+.2f}%) of {step / 1000:.1f} ms ({share:+.1f}% "
             f"of the rank's CPU time); two engines, tokens/s "
             f"{ratio:.3f}×", "≤ 3%"]]
