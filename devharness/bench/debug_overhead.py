"""`devharness bench debug-overhead`: what debug mode and the always-on worker state cost.

Part 1, tokens/s of one workload, side by side in one run: (a) no debugging, (b) `--debug` with no client
attached, (c) `--debug` with a DAP client attached to every worker, no breakpoints. Three engines stay
up for the whole run (rebuilding one per round would cost more than the workload and add start-up noise)
and take turns round by round in a rotating order, on fresh prompts each round, the same for all three.

Part 2, the worker state every rank publishes at each phase change and collective (debug/state.py):
on engine (a), decode steps with the StateRecorder's calls counted and timed, and decode steps with the
recorder installed and removed by turns (odd and even steps), timed inside the workers; likewise the
collective ledger (debug/ledger.py) alone, installed and removed by turns. All through the workers' profiler
(`LLMEngine.start_profile`: the "recorder-calls", "state-ab" and "ledger-ab" kinds of debug/profiler.py), so
any executor runs it.

Part 3, the driver's flight recorder (engine/record.py, always on: the last K steps kept for a bundle): decode
steps of engine (a) and of a fourth engine like it with `flight_steps=0`, by turns, timed at the driver; and the
time inside the recorder's calls, replayed on its own last steps.

Part 3 also times the driver's step records (engine/core.py's driver_steps, always on: the timeline's driver
process) the same way: what the engine does per step to keep one, replayed on its last steps. The ranks' side of
the timeline, their step histories and ledgers, is part 2's worker state and ledger.

Part 4, the KV sanitizer (`--kv-sanitizer`, on in debug mode), its KV checksums included (debug/kv_checksums.py): two
engines at tp=1 in this process, one with it and one without, given the same prompts each round (sharing their first
block; the first prompt a step ahead, so that the others' prefix hits are checked at handover) and stepped by turns,
one step of each at a time, so that a busy machine's load falls alike on both; tokens/s with it against without over
their steps' time, and the same in this thread's CPU time (the engines run in it: descheduling left out), the median
of per-round ratios with a bootstrap interval; then, in a fifth as many rounds more (timing each call costs the
sanitizer's engine alone, so not in those), where its steps' CPU time goes: the checksums and the workers' generation
checks (the workers' profiler, its "kv-checksums" kind), the driver's block-manager checks (LLMEngine.clock_scheduler).
`--part kv-sanitizer` runs this part alone (no Ray), `--part debug` the first three.

Part 5, the numerics check (`--numerics-check`; bench/numerics_overhead.py): two engines of the command's layout, with
and without it, side by side; `--part numerics` runs it alone (`--part all` leaves it out: run it per layout).
"""
from __future__ import annotations

import contextlib
import random
import statistics
import time

from devharness.bench.dap import AttachedClient, free_port_bases, wait_clients_seen
from devharness.bench.executor import positive_int, ray_for, start_decoding, timed
from devharness.bench.markdown import Table, add_flag, print_section

_CASES = ("no debug", "--debug, no client", "--debug, client attached")
ROUNDS = 5
KV_ROUNDS = 15   # a round of part 4 is a second or so; one round's ratio scatters by a few percent on a busy machine


def register(sub) -> None:
    from devharness.engine.args import EngineArgs
    p = sub.add_parser("debug-overhead", help="tokens/s without and with debug mode; cost of worker state publishing")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run, tp=2, executor="ray", threads_per_worker=1)
    p.add_argument("--num-requests", type=positive_int, default=16)
    p.add_argument("--prompt-len", type=positive_int, default=32)
    p.add_argument("--output-len", type=positive_int, default=64)
    p.add_argument("--rounds", type=positive_int, default=None,
                   help=f"rounds of each part; the engines take turns within each (default {ROUNDS}; the KV "
                        f"sanitizer's part, whose rounds are short: {KV_ROUNDS})")
    p.add_argument("--decode-batch", type=positive_int, default=8, help="batch of the state-publishing steps")
    p.add_argument("--phase-steps", type=positive_int, default=40,
                   help="state-publishing part: decode steps per round timed inside the recorder")
    p.add_argument("--ab-steps", type=positive_int, default=200,
                   help="state-publishing part: decode steps per round with the recorder on and off by turns")
    p.add_argument("--part", choices=("all", "debug", "kv-sanitizer", "numerics"), default="all",
                   help="debug: debug mode, worker state and flight recorder (parts 1-3); kv-sanitizer: part 4; "
                        "numerics: the numerics check on against off, in the command's layout (part 5)")
    add_flag(p)


def run(args) -> int:
    rows = []   # docs/benchmarks.md's table: [what, figure, target]
    asked = args.rounds
    args.rounds = asked or (KV_ROUNDS if args.part == "kv-sanitizer" else ROUNDS)   # what the table's note says
    if args.part in ("all", "debug"):
        rows += _run_debug(args)
    if args.part in ("all", "kv-sanitizer"):
        rows += _measure_sanitizer(args, asked or KV_ROUNDS)
    if args.part == "numerics":
        from devharness.bench.numerics_overhead import measure
        rows += measure(args, _prompts, _median_ci)
    if args.markdown:
        print_section([Table(["", "figure", "target"], rows)],
                      note=f"{args.model}, tp={args.tp} pp={args.pp}, {args.executor} executor, {args.num_requests} "
                           f"requests x {args.output_len} tokens, {args.rounds} rounds")
    return 0


def _run_debug(args) -> list[list[str]]:
    from devharness import LLM, SamplingParams
    from devharness.config import DebugConfig
    if args.executor == "uni":
        raise ValueError("--executor uni would open debugpy in this very process; use mp or ray")
    from devharness.engine.args import EngineArgs
    kw = EngineArgs.from_cli_args(args).kwargs()
    kw["max_concurrent_batches"] = 1   # each engine.step timed here runs one whole step
    world = args.tp * args.pp
    with ray_for(4 * world, args.executor == "ray", args.ray_address), contextlib.ExitStack() as stack:
        bases = free_port_bases(2, world)
        llms = [stack.enter_context(LLM(**kw))]
        llms += [stack.enter_context(LLM(**{**kw, "debug": DebugConfig(enabled=True, port_base=b)})) for b in bases]
        no_flight = stack.enter_context(LLM(**{**kw, "flight_steps": 0}))   # part 3's other side
        for rank in range(world):
            stack.enter_context(contextlib.closing(AttachedClient("127.0.0.1", bases[1] + rank)))
        wait_clients_seen(llms[2], world)
        print(f"model {args.model}, tp={args.tp} pp={args.pp}, {args.executor} executor"
              f"{f' ({args.ray_control_plane})' if args.executor == 'ray' else ''}, {args.threads_per_worker} "
              f"torch thread(s) per worker; {args.num_requests} requests x {args.output_len} tokens "
              f"(prompts {args.prompt_len} tokens); {args.rounds} rounds")
        params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
        for llm in llms:   # warm-up: first-step allocations, debugpy's first look at each thread
            llm.generate(_prompts(args, seed=-1)[:4], params)
        tokens_per_s = {c: [] for c in _CASES}
        for r in range(args.rounds):
            prompts = _prompts(args, seed=r)
            for i in range(3):
                case = (r + i) % 3
                t0 = time.perf_counter()
                llms[case].generate(prompts, params)
                tokens_per_s[_CASES[case]].append(args.num_requests * args.output_len / (time.perf_counter() - t0))
        rows = _report_tokens(tokens_per_s, args.rounds)
        flight = _measure_flight(args, llms[0].engine, no_flight.engine)
        rows += _measure_recorder(args, llms[0].engine)
    return rows + flight


def _prompts(args, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(0, 256) for _ in range(args.prompt_len)]}
            for _ in range(args.num_requests)]


def _report_tokens(tokens_per_s: dict, rounds: int) -> list[list[str]]:
    # Ratios within a round (the three ran back to back), then the median over rounds: load that drifts
    # between rounds cancels out.
    base = tokens_per_s[_CASES[0]]
    ratios = {case: statistics.median(x / b for x, b in zip(xs, base)) for case, xs in tokens_per_s.items()}
    print(f"\n  {'case':<27}{'tokens/s':>10}{'min':>9}{'max':>9}{'vs no debug':>13}")
    for case, xs in tokens_per_s.items():
        print(f"  {case:<27}{statistics.median(xs):10.1f}{min(xs):9.1f}{max(xs):9.1f}{ratios[case]:12.3f}x")
    ratio = ratios[_CASES[1]]
    print(f"  --debug with no client: {ratio:.3f}x no debug (median of per-round ratios; target >= 0.95x: "
          f"{'met' if ratio >= 0.95 else 'NOT met'})")
    return [["`--debug`, no client attached, vs no debugging", f"{ratio:.3f}× (median of {rounds} rounds)", "≥ 0.95×"],
            ["`--debug`, client attached, no breakpoints", f"{ratios[_CASES[2]]:.3f}×", ""]]


# -- part 2: the state recorder, measured inside the workers -------------------------------------------

def _profiled(engine, kind: str, warmup: int, steps: int, **kw) -> tuple[list, list[float]]:
    """Each rank's ProfileResult of `kind` over `warmup` + `steps` engine steps; the timed steps' us."""
    engine.start_profile(kind, **kw)
    try:
        us = timed(engine.step, warmup, steps)
    finally:
        results = engine.stop_profile()
    return results, us


def _step_diffs(results) -> list[list[float]]:
    """Per rank: per pair of neighbouring steps, the one with what the A/B turns on minus the one without (CPU us)."""
    return [[on - off for off, on in r.pairs_us] for r in results]


def _probe_stats(results) -> list[dict]:
    """Per rank: steps, phase changes (set_phase / enter / leave), seconds in the recorder, and each method's
    (calls, seconds)."""
    return [{"steps": r.steps, "set_phase_calls": sum(r.calls[n].calls for n in ("set_phase", "enter", "leave")),
             "recorder_s": sum(c.seconds for c in r.calls.values()),
             "by_call": {n: (c.calls, c.seconds) for n, c in r.calls.items() if c.calls}} for r in results]


def _measure_recorder(args, engine) -> list[list[str]]:
    ab, ledger_ab, probes, baselines, step_ms = [], [], [], [], []
    for r in range(args.rounds):
        start_decoding(engine, args.decode_batch, args.prompt_len, 2 * args.ab_steps + 2 * args.phase_steps + 12,
                       seed=r)
        # Every rank runs odd steps with the recorder and even steps without it (all ranks alike, so no
        # rank waits for another that publishes), timing each in the worker: neighbouring steps share
        # whatever load the machine has, and the driver's own noise stays out.
        results, us = _profiled(engine, "state-ab", 2, args.ab_steps)
        step_ms += [x / 1000 for x in us]
        ab.append(_step_diffs(results))
        ledger_ab.append(_step_diffs(_profiled(engine, "ledger-ab", 2, args.ab_steps)[0]))   # the ledger alone
        probes.append(_probe_stats(_profiled(engine, "recorder-calls", 3, args.phase_steps)[0]))
        # The same probe around do-nothing stand-ins: what timing a call just after a collective's
        # wait costs by itself (the probe, cold caches), to subtract from the recorder's figure.
        baselines.append(_probe_stats(_profiled(engine, "recorder-calls", 3, args.phase_steps, stand_ins=True)[0]))
        engine.abort_all_requests()   # part 1's next round must find this engine empty
    step = statistics.median(step_ms)
    print(f"\nworker state publishing (always on), decode steps at batch {args.decode_batch} "
          f"({step:.2f} ms a step at the driver):")
    worst = worst_net = 0.0
    for rank in range(len(probes[0])):
        n_steps = sum(p[rank]["steps"] for p in probes)
        calls = sum(p[rank]["set_phase_calls"] for p in probes) / n_steps
        us = sum(p[rank]["recorder_s"] for p in probes) / n_steps * 1e6
        base_steps = max(1, sum(p[rank]["steps"] for p in baselines))
        base_us = sum(p[rank]["recorder_s"] for p in baselines) / base_steps * 1e6
        worst, worst_net = max(worst, us), max(worst_net, us - base_us)
        by: dict[str, list] = {}
        for p in probes:
            for name, (n, secs) in p[rank]["by_call"].items():
                by.setdefault(name, [0, 0.0])
                by[name][0] += n
                by[name][1] += secs
        print(f"  rank {rank}: {calls:.1f} phase changes + 1 step boundary per step: {us:.0f} us per step "
              f"in the recorder ({n_steps} steps); the probe around do-nothing stand-ins: {base_us:.0f} us")
        print("    " + ", ".join(f"{name} {n / n_steps:.0f}x {secs / n * 1e6:.1f} us" for name, (n, secs) in by.items()))
    share, net = worst / 1000 / step * 100, worst_net / 1000 / step * 100
    print(f"  time in the recorder = {share:.2f}% of a {step:.2f} ms decode step (slowest rank), "
          f"{net:.2f}% beyond the stand-ins (target <= 2%: {'met' if net <= 2 else 'NOT met'})")
    # A call right after a collective's wait finds cold caches, which the code after it might meet anyway;
    # the A/B says what the step pays in all.
    worst_ab = None
    for rank in range(len(ab[0])):
        diffs = [x for a in ab for x in a[rank]]
        mid, lo, hi = _median_ci(diffs)
        worst_ab = (mid, lo, hi) if worst_ab is None or mid > worst_ab[0] else worst_ab
        print(f"  A/B, rank {rank}: a step with the recorder costs {mid:+.0f} us of CPU time (95% CI {lo:+.0f} to "
              f"{hi:+.0f}; median of {len(diffs)} pairs of neighbouring steps, with and without it)")
    mid, lo, hi = (x / 1000 / step * 100 for x in worst_ab)
    print(f"  A/B, recorder installed / removed: {mid:+.2f}% of a step (95% CI {lo:+.2f}% to {hi:+.2f}%; "
          f"slowest rank; target <= 2% for the whole interval: {'met' if hi <= 2 else 'NOT met'})")
    rows = [[f"always-on worker state, per {step:.1f} ms decode step, installed / removed by turns",
             f"{mid:+.2f}% (95% CI {lo:+.2f}% to {hi:+.2f}%)", "≤ 2%"]]
    worst_ab = None
    for rank in range(len(ledger_ab[0])):
        diffs = [x for a in ledger_ab for x in a[rank]]
        mid, lo, hi = _median_ci(diffs)
        worst_ab = (mid, lo, hi) if worst_ab is None or mid > worst_ab[0] else worst_ab
    mid, lo, hi = (x / 1000 / step * 100 for x in worst_ab)
    print(f"  A/B, collective ledger installed / removed: {worst_ab[0]:+.0f} us = {mid:+.2f}% of a step (95% CI "
          f"{lo:+.2f}% to {hi:+.2f}%; slowest rank; target <= 1%: {'met' if mid <= 1 else 'NOT met'})")
    return rows + [["always-on collective ledger, installed / removed by turns",
                    f"{worst_ab[0]:+.0f} µs = {mid:+.2f}% (95% CI {lo:+.2f}% to {hi:+.2f}%)", "≤ 1%"]]


# -- part 3: the flight recorder, at the driver ---------------------------------------------------------

def _measure_flight(args, on, off) -> list[list[str]]:
    """`on`: engine (a), with its flight recorder; `off`: the same settings with flight_steps=0. Decode steps of the
    two by turns, timed at the driver, on the same prompts; then the recorder's own calls, replayed on a copy of
    its last steps (LLMEngine.flight_recorder's window)."""
    from devharness.engine.record import FlightRecorder
    from devharness.protocol.recording import RecordedStep
    kept = on.flight_recorder
    if kept is None:
        print("\nflight recorder: off (--flight-steps 0): nothing to measure")
        return []
    diffs, step_us = [], []
    for r in range(args.rounds):
        for engine in (on, off):
            start_decoding(engine, args.decode_batch, args.prompt_len, args.ab_steps // 2 + 8, seed=1000 + r)
        last_off = None
        for i in range(args.ab_steps):   # off, on, off, on ...: each "on" step against the "off" before it
            engine = on if i % 2 else off
            t0 = time.perf_counter()
            engine.step()
            us = (time.perf_counter() - t0) * 1e6
            step_us.append(us)
            if i % 2:
                diffs.append(us - last_off)
            else:
                last_off = us
        for engine in (on, off):
            engine.abort_all_requests()
    # What the engine does per step with a recorder: a RecordedStep of the step's message and output, begin, end;
    # on the recorder's own last steps, a copy filled with them first (each end then drops the oldest, as in a run).
    _, steps, _ = kept.window()
    copy = FlightRecorder(kept.capacity)

    def replay() -> None:
        for s in steps:
            copy.begin(s.scheduler_output)
            copy.end(RecordedStep(s.scheduler_output, s.req_ids, s.sampled_token_ids, s.logits_digest))

    replay()   # fills the copy
    t0 = time.perf_counter()
    replay()
    replay()
    inside = (time.perf_counter() - t0) / max(1, 2 * len(steps)) * 1e6
    step = statistics.median(step_us)
    timeline_us = _driver_steps_us(on.driver_timeline().steps)
    mid, lo, hi = _median_ci(diffs)
    print(f"\nflight recorder (always on, last {kept.capacity} steps at the driver), decode steps at batch "
          f"{args.decode_batch} ({step / 1000:.2f} ms a step at the driver):")
    print(f"  inside its calls: {inside:.1f} us per step = {inside / step * 100:.3f}% of a step "
          f"(its calls replayed on its last {len(steps)} steps)")
    print(f"  A/B, on / off by turns: {mid:+.0f} us a step (95% CI {lo:+.0f} to {hi:+.0f}; {len(diffs)} pairs) = "
          f"{mid / step * 100:+.2f}% (CI {lo / step * 100:+.2f}% to {hi / step * 100:+.2f}%); target <= 1%: "
          f"{'met' if inside / step * 100 <= 1 and mid / step * 100 <= 1 else 'NOT met'}")
    print(f"\ndriver step records (always on, the timeline's driver process): {timeline_us:.2f} us per step = "
          f"{timeline_us / step * 100:.3f}% of a step (its calls replayed on the last steps; target <= 1%: "
          f"{'met' if timeline_us / step * 100 <= 1 else 'NOT met'})")
    return [["driver step records (the timeline's driver process), inside their calls",
             f"{timeline_us:.2f} µs = {timeline_us / step * 100:.3f}% of a step", "≤ 1%"],
            [f"flight recorder (last {kept.capacity} steps), on / off by turns",
             f"{mid / step * 100:+.2f}% (95% CI {lo / step * 100:+.2f}% to {hi / step * 100:+.2f}%); inside its calls "
             f"{inside / step * 100:.3f}%", "≤ 1%"]]


def _driver_steps_us(recs: list) -> float:
    """Microseconds per step inside what EngineCore does to keep its driver step records (a record made and kept at
    submit, found and filled in at collect), replayed on a copy of its last steps `recs`."""
    from collections import deque
    from devharness.engine.core import DRIVER_STEPS
    from devharness.protocol.messages import DriverStep
    if not recs:
        return 0.0
    copy = deque(maxlen=DRIVER_STEPS)

    def replay() -> None:
        for r in recs:
            copy.append(DriverStep(r.step, r.scheduled, time.time(), tokens=r.tokens))
            for rec in reversed(copy):   # EngineCore._driver_step
                if rec.step == r.step:
                    rec.done, rec.applied = time.time(), time.time()
                    break

    replay()   # fills the copy
    t0 = time.perf_counter()
    for _ in range(5):
        replay()
    return (time.perf_counter() - t0) / (5 * len(recs)) * 1e6


# -- part 4: the KV sanitizer, two engines side by side -----------------------------------------------------

def _measure_sanitizer(args, rounds: int) -> list[list[str]]:
    from devharness import LLM, SamplingParams
    from devharness.engine.args import EngineArgs
    kw = EngineArgs.from_cli_args(args).kwargs()
    kw.update(tensor_parallel_size=1, pipeline_parallel_size=1, distributed_executor_backend="uni",
              max_concurrent_batches=1, pp_layer_partition=None)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    wall: dict[bool, list[float]] = {False: [], True: []}   # per round, seconds in each engine's steps
    cpu: dict[bool, list[float]] = {False: [], True: []}    # the same in this thread's CPU time (the engine runs in it)
    with LLM(**{**kw, "kv_sanitizer": False}) as off, LLM(**{**kw, "kv_sanitizer": True}) as on:
        engines = {False: off.engine, True: on.engine}
        for llm in (off, on):   # warm-up
            llm.generate(_shared_first_block(_prompts(args, seed=-1)[:4], args.block_size), params)
        for r in range(rounds):
            prompts = _shared_first_block(_prompts(args, seed=2000 + r), args.block_size)
            for sanitizer, (w, c) in _steps_in_turns(engines, prompts, params).items():
                wall[sanitizer].append(w)
                cpu[sanitizer].append(c)
        # Where its time goes, in rounds of their own: timing each call costs the sanitizer's engine alone.
        driver = on.engine.clock_scheduler()       # the driver's side: the block manager's checks
        on.engine.start_profile("kv-checksums")   # the workers' side: checksums, generations
        try:
            steps_cpu = sum(_steps_in_turns(engines, _shared_first_block(_prompts(args, seed=2000 + r),
                                                                          args.block_size), params)[True][1]
                            for r in range(rounds, rounds + max(1, rounds // 5)))
        finally:
            [calls] = [r.calls for r in on.engine.stop_profile()]
    tokens = args.num_requests * args.output_len
    ratios = [off_s / on_s for on_s, off_s in zip(wall[True], wall[False])]    # tokens/s with / without
    cpu_ratios = [off_s / on_s for on_s, off_s in zip(cpu[True], cpu[False])]
    ratio, lo, hi = _median_ci(ratios)
    cpu_ratio, cpu_lo, cpu_hi = _median_ci(cpu_ratios)
    share, generations, driver_checks = (secs / steps_cpu * 100 for secs in (
        calls["checksums"].seconds, calls["generations"].seconds, driver.kv_check_s))
    taken, verified = calls["blocks checksummed"].calls, calls["blocks verified"].calls
    print(f"\nKV sanitizer ({args.model}, tp=1, {args.num_requests} requests x {args.output_len} tokens, "
          f"{rounds} rounds; in each, the two engines step by turns):")
    for sanitizer, secs in wall.items():
        xs = [tokens / x for x in secs]
        print(f"  {'on' if sanitizer else 'off':<4}{statistics.median(xs):10.1f} tokens/s (min {min(xs):.1f}, max "
              f"{max(xs):.1f})")
    print(f"  with the sanitizer: {ratio:.3f}x without (median of per-round ratios, 95% CI {lo:.3f} to {hi:.3f}; "
          f"rounds {min(ratios):.3f} to {max(ratios):.3f}; cost {(1 - ratio) * 100:+.1f}%; target <= 5%: "
          f"{'met' if ratio >= 0.95 else 'NOT met'})")
    print(f"  in CPU time (the engines' thread, descheduling left out): {cpu_ratio:.3f}x without (95% CI "
          f"{cpu_lo:.3f} to {cpu_hi:.3f}; cost {(1 - cpu_ratio) * 100:+.1f}%)")
    print(f"  of its steps' CPU time ({max(1, rounds // 5)} more rounds, each call timed): the KV checksums "
          f"{share:.2f}%, the workers' generation checks {generations:.2f}%, the driver's block-manager checks "
          f"{driver_checks:.2f}% ({taken} blocks checksummed, {verified} verified)")
    return [[f"KV sanitizer with its KV checksums (two engines at tp=1, with and without it, {args.num_requests} "
             f"requests x {args.output_len} tokens sharing their first block, stepped by turns)",
             f"{args.model} {ratio:.3f}× (95% CI {lo:.3f} to {hi:.3f}, {rounds} rounds); in CPU time "
             f"{cpu_ratio:.3f}×; in the checksums {share:.2f}% of its steps' CPU time ({taken} blocks checksummed, "
             f"{verified} verified), in the driver's and the workers' bookkeeping checks {driver_checks:.2f}% and "
             f"{generations:.2f}%", "≥ 0.95×"]]


def _steps_in_turns(engines: dict, prompts: list[dict], params) -> dict:
    """Both engines given `prompts` (the first one a step ahead, so that the others are handed its first block by a
    prefix hit), stepped one step each by turns (which goes first alternating) until both are idle: per engine, the
    seconds in its steps, wall and this thread's CPU time. A busy machine's load drifts over seconds: neighbouring
    steps, milliseconds apart, share it."""
    spent = {key: [0.0, 0.0] for key in engines}
    order = list(engines)

    def turn() -> None:
        for key in order:
            engine = engines[key]
            if engine.has_unfinished_requests():
                t0, cpu0 = time.perf_counter(), time.thread_time()
                engine.step()
                spent[key][0] += time.perf_counter() - t0
                spent[key][1] += time.thread_time() - cpu0
        order.reverse()

    for batch in (prompts[:1], prompts[1:]):
        for engine in engines.values():
            for p in batch:
                engine.add_request(p, params)
        turn()
    while any(e.has_unfinished_requests() for e in engines.values()):
        turn()
    for engine in engines.values():
        engine.reset_prefix_cache()
    return {key: tuple(x) for key, x in spent.items()}


def _shared_first_block(prompts: list[dict], block_size: int) -> list[dict]:
    """The prompts, each with the first one's first block: every request after the first is handed it by a prefix
    hit."""
    first = prompts[0]["prompt_token_ids"][:block_size]
    return [{"prompt_token_ids": first + p["prompt_token_ids"][block_size:]} for p in prompts]


def _median_ci(xs: list[float], rounds: int = 1000) -> tuple[float, float, float]:
    """The median and a bootstrap 95% interval for it."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(rounds))
    return statistics.median(xs), meds[int(0.025 * rounds)], meds[int(0.975 * rounds) - 1]
