"""`devharness bench throughput --pipeline`: pipeline parallelism with one batch in flight, with pp batches in
flight (the default), and pp=1 on the same cores (one worker with pp x threads_per_worker torch threads), side
by side in one run: the same workload on each, round by round in a rotating order, so that load from the other
tenants of a small machine hits all three alike. Prints tokens/s, the median of the per-round ratios, and the
ratios of each case's fastest round.
"""
from __future__ import annotations

import contextlib
import statistics
import time

from devharness.bench.markdown import Table, print_section, ratio


def refuse_one_worker(args) -> None:
    """`--pipeline` (or `--pp N`, N >= 2) on the uni executor: refused, saying it is the pipeline comparison (before
    the configs' own check of tp x pp against the executor, which would not say why pp was 2)."""
    if (args.pipeline or args.pp > 1) and args.executor == "uni":
        raise ValueError("--pipeline runs several workers: use --executor mp or ray")


def _cases(pp: int, threads: int) -> dict[str, dict]:
    return {"pp=1": {"pipeline_parallel_size": 1, "threads_per_worker": pp * threads, "max_concurrent_batches": 1,
                     "pp_layer_partition": None},
            f"pp={pp}, 1 batch in flight": {"pipeline_parallel_size": pp, "threads_per_worker": threads,
                                            "max_concurrent_batches": 1},
            f"pp={pp}, {pp} batches in flight": {"pipeline_parallel_size": pp, "threads_per_worker": threads,
                                                 "max_concurrent_batches": pp}}


def run(args) -> int:
    from devharness import LLM
    from devharness.bench.executor import ray_for
    from devharness.bench.workload import make_workload, run_engine
    from devharness.engine.args import EngineArgs
    kw = EngineArgs.from_cli_args(args).kwargs()
    pp = max(2, args.pp)
    refuse_one_worker(args)
    backend = args.executor or "mp"
    kw["distributed_executor_backend"] = backend
    threads = args.threads_per_worker = args.threads_per_worker or 1
    cases = _cases(pp, threads)
    world = args.tp * pp
    with ray_for(3 * world, backend == "ray", args.ray_address), contextlib.ExitStack() as stack:
        llms = {name: stack.enter_context(LLM(**{**kw, **case})) for name, case in cases.items()}
        first = next(iter(llms.values()))
        workload = make_workload(args, first.engine.source.arch.vocab_size)
        n_out = sum(n for _, n in workload)
        model_name = first.engine.source.name
        # The pp=N engines' partition: the one given, else the engine's balanced default.
        parts = llms[f"pp={pp}, 1 batch in flight"].engine.config.parallel.pp_layer_partition
        split = f"layers {','.join(map(str, parts))} per stage" + ("" if kw.get("pp_layer_partition") else
                                                                   " (the balanced default)")
        print(f"model {first.engine.source.name}, {backend} executor, tp={args.tp}, {split}; {len(workload)} requests, prompts "
              f"{args.prompt_len[0]}-{args.prompt_len[1]} tokens, outputs {args.output_len[0]}-{args.output_len[1]} "
              f"tokens ({n_out} in all); {args.threads_per_worker} torch thread(s) per worker at pp={pp}, "
              f"{pp * args.threads_per_worker} at pp=1; {args.rounds} rounds")
        for llm in llms.values():   # warm-up
            run_engine(llm, workload[:4])
        names = list(llms)
        tokens_per_s: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                t0 = time.perf_counter()
                run_engine(llms[name], workload)
                tokens_per_s[name].append(n_out / (time.perf_counter() - t0))
    _report(tokens_per_s, names, pp)
    if args.markdown:
        print_section(markdown_blocks(tokens_per_s, names, pp, threads),
                      note=f"{model_name}, {kw['dtype']}, {backend}, {split}, {n_out} output tokens, "
                           f"{args.rounds} rounds")
    return 0


def _ratio(tokens_per_s: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of a's tokens/s over b's in the same round (the cases ran back to back)."""
    return statistics.median(x / y for x, y in zip(tokens_per_s[a], tokens_per_s[b]))


def markdown_blocks(tokens_per_s: dict[str, list[float]], names: list[str], pp: int, threads: int) -> list:
    """docs/benchmarks.md's table: each case's median tokens/s, then N in flight against 1 in flight and against
    pp=1, the median of the per-round ratios with the fastest rounds' ratio beside it, and the targets."""
    single, one, many = names
    best = {name: max(tokens_per_s[name]) for name in names}
    med = {name: statistics.median(tokens_per_s[name]) for name in names}
    rows = [[f"pp=1 (1 worker, {pp * threads} threads)", f"{med[single]:.1f} tokens/s", ""],
            [one, f"{med[one]:.1f}", ""], [many, f"{med[many]:.1f}", ""]]
    for other, words, target in ((one, "1 in flight", "≥ 1.6×"), (single, "pp=1", "≥ 0.9×")):
        rows.append([f"**{pp} in flight / {words}**: median of rounds (fastest rounds)",
                     f"**{ratio(_ratio(tokens_per_s, many, other), 3)}** ({ratio(best[many] / best[other], 3)})",
                     target])
    return [Table(["", "this run", "target"], rows)]


def _report(tokens_per_s: dict[str, list[float]], names: list[str], pp: int) -> None:
    # Ratios within a round (the cases ran back to back), then the median over rounds.
    def ratio(a: str, b: str) -> float:
        return _ratio(tokens_per_s, a, b)

    single, one, many = names
    print(f"\n  {'case':<28}{'tokens/s':>10}{'min':>9}{'max':>9}{'vs pp=1':>10}")
    for name in names:
        xs = tokens_per_s[name]
        print(f"  {name:<28}{statistics.median(xs):10.1f}{min(xs):9.1f}{max(xs):9.1f}{ratio(name, single):9.3f}x")
    vs_one, vs_single = ratio(many, one), ratio(many, single)
    print(f"  {many}: {vs_one:.3f}x {one} (target >= 1.6x: {_verdict(vs_one, 1.6)}), "
          f"{vs_single:.3f}x pp=1 (target >= 0.9x: {_verdict(vs_single, 0.9)})")
    # Each case's fastest round: the one the machine's other tenants disturbed least. Load from them costs the
    # case that keeps every core busy (pp batches in flight) most, so a busy round lowers its ratios above.
    best = {name: max(tokens_per_s[name]) for name in names}
    best_one, best_single = best[many] / best[one], best[many] / best[single]
    print(f"  fastest rounds: {many}: {best_one:.3f}x {one} (target >= 1.6x: {_verdict(best_one, 1.6)}), "
          f"{best_single:.3f}x pp=1 (target >= 0.9x: {_verdict(best_single, 0.9)})")


def _verdict(ratio: float, target: float) -> str:
    return "met" if ratio >= target else "NOT met"
