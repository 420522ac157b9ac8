"""`devharness bench executor`: the per-step round trip of each control plane, side by side in one run.

Two round trips per case: an empty step (a SchedulerOutput with nothing scheduled, sent straight to
`executor.execute_model`: the engine itself skips empty steps), which is the control plane alone, and a real
engine decode step at a small batch, which is what a user waits for. Cases: uni (one worker, for reference),
mp, and Ray with a Compiled Graph and with the shm ring. Beside them the floor of the plainest Ray control plane:
the same empty step message sent by plain Ray actor calls to as many no-op actors of this bench's own (nothing
decoded, nothing run), which is Ray's own round trip, outside the engine.

Every engine stays up for the whole run and the cases take turns, round by round, in a rotating order,
so that load from the other tenants of a small machine hits all of them alike. Between turns a case's
workers sit idle and their channels back off to long sleeps: a few untimed steps open each turn.
"""
from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from typing import Callable

from devharness.bench.markdown import Table, add_flag, print_section, ratio
from devharness.config import positive_int  # noqa: F401  (the benches' flags take it from here)

# name -> (backend, ray control plane); "actors": no engine, the bench's own no-op Ray actors
CASES = {
    "uni": ("uni", None),
    "mp": ("mp", None),
    "ray-actor-calls": ("actors", None),
    "ray-cgraph": ("ray", "cgraph"),
    "ray-shm": ("ray", "shm"),
}
_WARMUP_STEPS = 3


def _case_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in CASES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown case(s) {bad or text!r}; choose from {', '.join(CASES)}")
    return names


def register(sub) -> None:
    p = sub.add_parser("executor", help="per-step round trip of uni, mp and the Ray control planes")
    p.set_defaults(func=run)
    from devharness.engine.args import add_option_flags
    add_option_flags(p, ["model", "tensor_parallel_size", "pipeline_parallel_size", "threads_per_worker"],
                     defaults={"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "threads_per_worker": 1},
                     notes={"tensor_parallel_size": "here: of the multi-worker cases, default 2", "threads_per_worker":
                            "default here: 1", "pipeline_parallel_size": "here: of the multi-worker cases, default 2"})
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--steps-per-round", type=positive_int, default=50, help="timed steps per case and round")
    p.add_argument("--decode-batch", type=positive_int, default=8, help="requests in decode during a decode step")
    p.add_argument("--prompt-len", type=positive_int, default=16)
    p.add_argument("--cases", type=_case_list, default=list(CASES), metavar="NAMES",
                   help=f"comma-separated subset of {','.join(CASES)}")
    add_flag(p)


# -- shared with bench debug-overhead -----------------------------------------------------------

@contextlib.contextmanager
def ray_for(num_workers: int, needed: bool, address: str | None = None):
    """A private local Ray with a CPU slot per worker of every engine alive at once (the executor would
    size one for a single engine), or the cluster at `address` / $RAY_ADDRESS; shut down on exit if
    this call started it."""
    if not needed:
        yield
        return
    import os
    import ray
    started = not ray.is_initialized()
    address = address or os.environ.get("RAY_ADDRESS") or None
    if started and address:
        ray.init(address=address, log_to_driver=False)
    elif started:
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, num_workers), include_dashboard=False,
                 log_to_driver=False)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def start_decoding(engine, batch: int, prompt_len: int, steps_ahead: int, seed: int = 0) -> None:
    """Leave exactly `batch` requests in decode with room for `steps_ahead` more tokens each, restarting
    them when they would run out (prefill is not what the decode cases measure)."""
    from devharness import SamplingParams
    room = engine.max_model_len - prompt_len - 1
    if steps_ahead > room:
        raise ValueError(f"{steps_ahead} decode steps in a row need max_model_len > {prompt_len + steps_ahead}; "
                         f"{engine.source.name} allows {engine.max_model_len}: lower --steps-per-round")
    snap = engine.scheduler_snapshot()
    if snap.num_running == batch and snap.all_decoding and all(r.num_tokens + steps_ahead < engine.max_model_len
                                                               for r in snap.running):
        return
    engine.abort_all_requests()
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=room, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request({"prompt_token_ids": [rng.randrange(0, 256) for _ in range(prompt_len)]}, params)
    while not engine.scheduler_snapshot().all_decoding:
        engine.step()


def timed(fn: Callable[[], object], warmup: int, steps: int) -> list[float]:
    """Microseconds of each of `steps` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1] if len(xs) > 1 else xs[0]


# -- the benchmark -----------------------------------------------------------------------------

def _build(args, stack: contextlib.ExitStack) -> dict:
    """One LLM per (backend, control plane) that some case needs."""
    from devharness import LLM
    llms = {}
    for name in args.cases:
        backend, mode = CASES[name]
        if backend == "actors" or (backend, mode) in llms:
            continue
        tp, pp = (1, 1) if backend == "uni" else (args.tp, args.pp)
        kw = {"ray_control_plane": mode} if mode else {}
        llms[(backend, mode)] = stack.enter_context(LLM(
            args.model, tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend=backend,
            max_concurrent_batches=1, threads_per_worker=args.threads_per_worker, **kw))
    return llms


class _NoOp:
    """A Ray actor that answers a step message at once: what a plain actor call costs, with nothing run."""

    def step(self, message: bytes) -> bytes:
        return b""


def _actor_calls(world: int, stack: contextlib.ExitStack, message: bytes) -> Callable[[], object]:
    """An empty step's message to `world` no-op actors by plain Ray actor calls, every answer awaited."""
    import ray
    actors = [ray.remote(num_cpus=0)(_NoOp).remote() for _ in range(world)]
    stack.callback(lambda: [ray.kill(a) for a in actors])
    ray.get([a.step.remote(message) for a in actors])   # started and reachable before any timing
    return lambda: ray.get([a.step.remote(message) for a in actors])


def _empty_message(engine):
    from devharness.protocol.messages import SchedulerOutput
    # The engine's own step number: an empty message changes nothing on the workers.
    return SchedulerOutput(engine.scheduler_snapshot().step, [], [], {}, [])


def run(args) -> int:
    import msgspec

    from devharness.config import ParallelConfig
    world = args.tp * args.pp
    num_ray = sum(world for backend, _ in {CASES[n] for n in args.cases} if backend == "ray")
    default_mode = ParallelConfig().ray_control_plane
    samples = {(name, kind): [] for name in args.cases for kind in ("empty", "decode")}
    needs_ray = any(CASES[n][0] in ("ray", "actors") for n in args.cases)
    with ray_for(num_ray, needs_ray, getattr(args, "ray_address", None)), contextlib.ExitStack() as stack:
        llms = _build(args, stack)
        any_engine = next(iter(llms.values())).engine if llms else None
        floor = (_actor_calls(world, stack, msgspec.msgpack.encode(_empty_message(any_engine)) if any_engine
                              else b"")
                 if "ray-actor-calls" in args.cases else None)
        import torch
        print(f"model {args.model}; multi-worker cases at tp={args.tp}, pp={args.pp}; {args.threads_per_worker} "
              f"torch thread(s) per worker; {args.rounds} rounds x {args.steps_per_round} steps per case; "
              f"decode batch {args.decode_batch}; driver torch threads {torch.get_num_threads()}")
        for r in range(args.rounds):
            order = args.cases[r % len(args.cases):] + args.cases[:r % len(args.cases)]
            for kind in ("empty", "decode"):
                for name in order:
                    backend, mode = CASES[name]
                    if backend == "actors":
                        if kind == "decode":
                            continue   # no-op actors run no model
                        step = floor
                    elif kind == "empty":
                        engine = llms[(backend, mode)].engine
                        step = (lambda ex, so: lambda: ex.execute_model(so))(engine.workers, _empty_message(engine))
                    else:
                        engine = llms[(backend, mode)].engine
                        start_decoding(engine, args.decode_batch, args.prompt_len,
                                       args.steps_per_round + _WARMUP_STEPS)
                        step = engine.step
                    samples[(name, kind)] += timed(step, _WARMUP_STEPS, args.steps_per_round)
    _report(args, samples, default_mode)
    if args.markdown:
        med = {k: statistics.median(v) for k, v in samples.items() if v}
        print_section(markdown_blocks(args, med, default_mode),
                      note=f"{args.model}, tp={args.tp} x pp={args.pp}, {args.threads_per_worker} torch thread(s) per "
                           f"worker, {args.rounds} rounds x {args.steps_per_round} steps")
    return 0


# The docs' words for each case (docs/benchmarks.md).
CASE_WORDS = {"uni": "uni (1 worker, reference)", "mp": "mp (shared-memory ring)",
              "ray-actor-calls": "Ray's floor: plain actor calls to no-op actors", "ray-cgraph": "ray, Compiled Graph",
              "ray-shm": "ray, shared-memory ring"}


def markdown_blocks(args, med: dict, default_mode: str) -> list:
    """docs/benchmarks.md's table: each case's median empty step (us) and decode step (ms), each against mp's; the
    default Ray mode in bold; then its ratios against mp, the floor and the other Ray mode."""
    def vs_mp(name, kind):
        return ratio(med[(name, kind)] / med[("mp", kind)]) if ("mp", kind) in med and (name, kind) in med else ""

    default = f"ray-{default_mode}"
    rows = []
    for name in args.cases:
        empty = f"{med[(name, 'empty')]:.0f} µs" if (name, "empty") in med else ""
        decode = f"{med[(name, 'decode')] / 1000:.1f} ms" if (name, "decode") in med else ""
        cells = [CASE_WORDS[name] + (" (default)" if name == default else ""), empty, vs_mp(name, "empty"), decode,
                 vs_mp(name, "decode")]
        rows.append([f"**{c}**" if c and name == default else c for c in cells])
    blocks = [Table(["control plane", "empty step", "vs mp", f"decode step ({args.decode_batch} requests)", "vs mp"],
                    rows)]
    said = []
    if (default, "empty") in med and ("ray-actor-calls", "empty") in med:
        said.append(f"{ratio(med[(default, 'empty')] / med[('ray-actor-calls', 'empty')])} Ray's plain-actor-call floor")
    other = "ray-cgraph" if default == "ray-shm" else "ray-shm"
    if (default, "empty") in med and (other, "empty") in med:
        said.append(f"{ratio(med[(other, 'empty')] / med[(default, 'empty')])} faster than the "
                    f"{CASE_WORDS[other].split(', ', 1)[1]} per empty step")
    if said:
        blocks.append(f"The default ({CASE_WORDS[default].split(', ', 1)[1]}) is " + " and ".join(said) + ".")
    return blocks


def _report(args, samples: dict, default_mode: str) -> None:
    med = {k: statistics.median(v) for k, v in samples.items() if v}
    for kind, title in (("empty", "empty step (control plane only; ray-actor-calls: no-op actors, Ray's own floor)"),
                        ("decode", f"decode step, {args.decode_batch} requests")):
        names = [name for name in args.cases if (name, kind) in med]
        if not names:
            continue
        print(f"\n{title}:")
        print(f"  {'case':<17}{'median us':>11}{'p90 us':>11}{'vs mp':>9}")
        for name in names:
            vs_mp = f"{med[(name, kind)] / med[('mp', kind)]:8.2f}x" if ("mp", kind) in med else f"{'-':>9}"
            print(f"  {name:<17}{med[(name, kind)]:11.0f}{p90(samples[(name, kind)]):11.0f}{vs_mp}")
    default = f"ray-{default_mode}"
    print(f"\ndefault Ray mode (ParallelConfig.ray_control_plane) = {default_mode!r}")
    for kind in ("empty", "decode"):
        parts = []
        if default in args.cases and "mp" in args.cases:
            parts.append(f"{med[(default, kind)] / med[('mp', kind)]:.2f}x mp (target <= 1.2x)")
        if default in args.cases and ("ray-actor-calls", kind) in med:
            parts.append(f"{med[(default, kind)] / med[('ray-actor-calls', kind)]:.2f}x plain actor calls to "
                         "no-op actors (target < 1x: below Ray's own floor)")
        if parts:
            print(f"  {kind + ' step:':<13} {default} = " + ", ".join(parts))
    ray_modes = [n for n in ("ray-shm", "ray-cgraph") if n in args.cases]
    if len(ray_modes) == 2:
        best = min(ray_modes, key=lambda n: med[(n, "empty")])
        print(f"  fastest Ray mode on empty steps this run: {best} "
              f"({med[('ray-cgraph', 'empty')] / med[('ray-shm', 'empty')]:.2f}x cgraph / shm)")
