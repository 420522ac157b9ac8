"""`devharness bench throughput --stories`: what keeping each request's story (engine/request_story.py) costs. The
same workload runs on two engines, request stories on and off (SchedulerConfig.request_stories), round by round in
turn, so that load from the other tenants of a small machine hits both alike. Timed: the scheduler's side of every
step (add_request, schedule, update_from_output, finish_request, note_batch_queue_full: every call the engine makes
into the scheduler, where the stories are told; in the engine thread's CPU time: engine/sched_clock.py), within it
the calls to the StoryBook themselves (engine on), and the run as a whole (wall clock). Prints, from the median
round: the scheduler's side on against off (across two engines), the StoryBook's own calls (in the same steps), each
as a share of the scheduler's side and of a whole step, and tokens/s on and off."""
from __future__ import annotations

import statistics

from devharness.bench.markdown import Table, print_section


def run(args) -> int:
    from devharness import LLM
    from devharness.bench.workload import make_workload, run_engine
    from devharness.engine.args import EngineArgs
    kw = EngineArgs.from_cli_args(args).kwargs()
    kw["distributed_executor_backend"] = "uni"
    with LLM(**{**kw, "request_stories": True}) as on, LLM(**{**kw, "request_stories": False}) as off:
        engines = {"on": on, "off": off}
        workload = make_workload(args, on.engine.source.arch.vocab_size)
        n_out = sum(n for _, n in workload)
        print(f"model {on.engine.source.name}, {len(workload)} requests, prompts {args.prompt_len[0]}-"
              f"{args.prompt_len[1]} tokens, outputs {args.output_len[0]}-{args.output_len[1]} tokens ({n_out} in "
              f"all), uni executor; request stories on against off, {args.rounds} rounds")
        clocks = {name: llm.engine.clock_scheduler() for name, llm in engines.items()}
        for llm in engines.values():
            run_engine(llm, workload[:4])   # warm-up
        rounds = []   # per round, per case: (scheduler s, run s, steps)
        for r in range(args.rounds):
            got = {}
            for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
                llm, clock = engines[name], clocks[name]
                clock.reset()
                step0 = llm.engine.scheduler_snapshot().step
                run_s = run_engine(llm, workload)
                got[name] = (clock.scheduler_s, run_s, llm.engine.scheduler_snapshot().step - step0)
                if name == "on":
                    got["stories"] = clock.stories_s
            rounds.append(got)
            print(f"round {r + 1}: " + ", ".join(f"stories {n}: scheduler {got[n][0] * 1e3:.1f} ms in "
                                                 f"{got[n][1]:.1f} s, {got[n][2]} steps" for n in ("on", "off"))
                  + f"; the StoryBook's calls {got['stories'] * 1e3:.1f} ms")
    per_step = {n: statistics.median(g[n][0] / g[n][2] for g in rounds) * 1e6 for n in ("on", "off")}
    step_us = statistics.median(g["on"][1] / g["on"][2] for g in rounds) * 1e6
    run_s = {n: statistics.median(g[n][1] for g in rounds) for n in ("on", "off")}
    own = statistics.median(g["stories"] / g["on"][0] for g in rounds)   # a share of the scheduler's side
    own_us = own * per_step["on"]
    diff = per_step["on"] - per_step["off"]
    print(f"the scheduler's side of a step (median of {args.rounds} rounds): stories on {per_step['on']:.1f} us, off "
          f"{per_step['off']:.1f} us ({diff:+.1f} us, {diff / per_step['off']:+.1%})")
    print(f"  the StoryBook's own calls: {own_us:.1f} us a step, {own:.1%} of the scheduler's side")
    print(f"a whole step (stories on): {step_us / 1e3:.2f} ms: the stories are {own_us / step_us:.3%} of it "
          f"(on against off: {diff / step_us:+.3%}; target <= 1%)")
    print(f"tokens/s: stories on {n_out / run_s['on']:.1f}, off {n_out / run_s['off']:.1f}")
    if args.markdown:
        met = "met" if max(own_us, diff) / step_us <= 0.01 else "not met"
        print_section([Table(["", "figure"], [
            ["the scheduler's side of a step, stories on / off (median)",
             f"{per_step['on']:.1f} / {per_step['off']:.1f} µs ({diff / per_step['off']:+.1%})"],
            ["the StoryBook's own calls in it", f"{own_us:.1f} µs a step, {own:.1%} of the scheduler's side"],
            ["a whole step, stories on (median)", f"{step_us / 1e3:.2f} ms"],
            ["**the stories' cost of a whole step**", f"**{own_us / step_us:.3%}** (on against off: "
             f"{diff / step_us:+.3%}); target ≤ 1%: {met}"],
            [f"tokens/s, {args.num_requests} requests, stories on / off",
             f"{n_out / run_s['on']:.1f} / {n_out / run_s['off']:.1f}"]])],
            note=f"{kw['model']}, {kw['dtype']}, uni executor, {args.rounds} rounds")
    return 0
