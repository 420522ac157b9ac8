"""`devharness bench debug-overhead`: what debug mode and the always-on worker state cost.

Part 1, tokens/s of one workload, side by side in one run: (a) no debugging, (b) `--debug` with no client
attached, (c) `--debug` with a DAP client attached to every worker, no breakpoints. Three engines stay
up for the whole run (rebuilding one per round would cost more than the workload and add start-up noise)
and take turns round by round in a rotating order, on fresh prompts each round, the same for all three.

Part 2, the worker state every rank publishes at each phase change and collective (debug/state.py):
on engine (a), decode steps with the StateRecorder wrapped to count and time its calls, and decode steps
with the recorder installed vs removed (interleaved blocks). Code reaches the workers through Ray's
`__ray_call__` (a developer API that runs a function on the actor), so part 2 needs `--executor ray`.
"""
from __future__ import annotations

import contextlib
import json
import random
import socket
import statistics
import threading
import time

from devharness.bench.executor import positive_int, ray_for, start_decoding, timed
from devharness.debug import state as debug_state

_CASES = ("no debug", "--debug, no client", "--debug, client attached")
_AB_BLOCK = 5   # steps per block in the recorder's on/off comparison


def register(sub, add_engine_args) -> None:
    p = sub.add_parser("debug-overhead", help="tokens/s without and with debug mode; cost of worker state publishing")
    add_engine_args(p)
    p.set_defaults(func=run, tp=2, executor="ray")
    p.add_argument("--num-requests", type=positive_int, default=16)
    p.add_argument("--prompt-len", type=positive_int, default=32)
    p.add_argument("--output-len", type=positive_int, default=64)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--threads-per-worker", type=positive_int, default=1, help="torch threads in each worker")
    p.add_argument("--decode-batch", type=positive_int, default=8, help="batch of the state-publishing steps")
    p.add_argument("--phase-steps", type=positive_int, default=40,
                   help="state-publishing part: timed decode steps per round with the recorder on, off, probed")


def run(args) -> int:
    from devharness import LLM, SamplingParams
    from devharness.cli import llm_kwargs
    from devharness.config import DebugConfig
    if args.executor == "uni":
        raise ValueError("--executor uni would open debugpy in this very process; use mp or ray")
    kw = llm_kwargs(args)
    kw["threads_per_worker"] = args.threads_per_worker
    world = args.tp * args.pp
    with ray_for(3 * world, args.executor == "ray"), contextlib.ExitStack() as stack:
        bases = _free_port_bases(2, world)
        llms = [stack.enter_context(LLM(**kw))]
        llms += [stack.enter_context(LLM(**kw, debug=DebugConfig(enabled=True, port_base=b))) for b in bases]
        for rank in range(world):
            stack.enter_context(contextlib.closing(_AttachedClient("127.0.0.1", bases[1] + rank)))
        _wait_clients_seen(llms[2], world)
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
        _report_tokens(tokens_per_s)
        if args.executor != "ray":
            print("\nworker state publishing: skipped (measured through Ray actors: use --executor ray)")
            return 0
        _measure_recorder(args, llms[0].engine)
    return 0


def _prompts(args, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(0, 256) for _ in range(args.prompt_len)]}
            for _ in range(args.num_requests)]


def _report_tokens(tokens_per_s: dict) -> None:
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


# -- part 2: the state recorder, measured inside the workers -------------------------------------------

def _measure_recorder(args, engine) -> None:
    executor = engine.core.executor
    steps_ms, pair_ratios, probes, baselines = {True: [], False: []}, [], [], []
    pairs = -(-args.phase_steps // _AB_BLOCK)
    for r in range(args.rounds):
        start_decoding(engine, args.decode_batch, args.prompt_len, 2 * pairs * (_AB_BLOCK + 1) + args.phase_steps + 3,
                       seed=r)
        # Blocks of a few steps, recorder on and off by turns: load that drifts over seconds hits both alike.
        for i in range(pairs):
            block_ms = {}
            for installed in ((True, False) if (r + i) % 2 == 0 else (False, True)):
                _on_workers(executor, _set_recorder, installed)
                try:
                    block_ms[installed] = [us / 1000 for us in timed(engine.step, 1, _AB_BLOCK)]
                finally:
                    _on_workers(executor, _set_recorder, True)
                steps_ms[installed] += block_ms[installed]
            pair_ratios.append(statistics.median(block_ms[True]) / statistics.median(block_ms[False]))
        _on_workers(executor, _probe_start)
        timed(engine.step, 3, args.phase_steps)
        probes.append(_on_workers(executor, _probe_stop))
        # The same probe around do-nothing stand-ins: what timing a call just after a collective's
        # wait costs by itself (the probe, cold caches), to subtract from the recorder's figure.
        _on_workers(executor, _probe_start, True)
        timed(engine.step, 3, args.phase_steps)
        baselines.append(_on_workers(executor, _probe_stop))
        for rid in list(engine._trackers):   # part 1's next round must find this engine empty
            engine.abort_request(rid)
    step_ms = statistics.median(steps_ms[True])
    print(f"\nworker state publishing (always on), decode steps at batch {args.decode_batch}:")
    worst = worst_net = 0.0
    for rank in range(len(probes[0])):
        n_steps = sum(p[rank]["steps"] for p in probes)
        calls = sum(p[rank]["set_phase_calls"] for p in probes) / n_steps
        us = sum(p[rank]["recorder_s"] for p in probes) / n_steps * 1e6
        base_steps = max(1, sum(p[rank]["steps"] for p in baselines))
        base_us = sum(p[rank]["recorder_s"] for p in baselines) / base_steps * 1e6
        worst, worst_net = max(worst, us), max(worst_net, us - base_us)
        by = {}
        for p in probes:
            for name, (n, s) in p[rank]["by_call"].items():
                by[name] = (by.get(name, (0, 0))[0] + n, by.get(name, (0, 0))[1] + s)
        print("   ", ", ".join(f"{k} {n / n_steps:.1f}/step {s / n * 1e6:.1f} us" for k, (n, s) in by.items()))
        print(f"  rank {rank}: {calls:.1f} phase changes + 1 step boundary per step: {us:.0f} us per step "
              f"in the recorder ({us / (calls + 1):.1f} us each; {n_steps} steps); the probe around "
              f"do-nothing stand-ins: {base_us:.0f} us")
    share, net = worst / 1000 / step_ms * 100, worst_net / 1000 / step_ms * 100
    print(f"  time in the recorder = {share:.2f}% of a {step_ms:.2f} ms decode step (slowest rank), "
          f"{net:.2f}% beyond the stand-ins (target <= 2%: {'met' if net <= 2 else 'NOT met'})")
    # A call right after a collective's wait finds cold caches, which the code after it would meet anyway:
    # the time inside the recorder is an upper bound, the A/B the marginal cost (but noisy).
    print(f"  A/B, recorder installed / removed, {len(pair_ratios)} pairs of {_AB_BLOCK}-step blocks: "
          f"{statistics.median(pair_ratios):.3f}x (median of pair ratios; step medians {step_ms:.2f} vs "
          f"{statistics.median(steps_ms[False]):.2f} ms)")


def _on_workers(executor, fn, *args) -> list:
    import ray
    return ray.get([a.__ray_call__.remote(_call_worker, fn, *args) for a in executor.actors])


def _call_worker(actor, fn, *args):
    return fn(actor.worker, *args)


def _set_recorder(worker, installed: bool) -> None:
    # Without a recorder the runner, layers and collectives publish nothing (they check for None).
    debug_state.install_recorder(worker.recorder if installed else None)


def _do_nothing(*args, **kwargs) -> None:
    return None


class _Probe:
    """Wraps one StateRecorder's methods (as instance attributes) to count set_phase calls and time all
    recorder work; nested calls (begin_step calls set_phase) count once in the time."""

    def __init__(self, rec: debug_state.StateRecorder, stand_ins: bool = False):
        self.rec, self.depth = rec, 0
        self.stats = {"set_phase_calls": 0, "steps": 0, "recorder_s": 0.0, "by_call": {}}
        for name in ("set_phase", "enter", "leave", "begin_step", "end_step"):
            setattr(rec, name, self._wrap(name, _do_nothing if stand_ins else getattr(rec, name)))

    def _wrap(self, name: str, fn):
        def wrapped(*args, **kwargs):
            self.stats["set_phase_calls"] += name in ("set_phase", "enter", "leave")
            self.stats["steps"] += name == "end_step"
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if not self.depth:
                    dt = time.perf_counter() - t0
                    self.stats["recorder_s"] += dt
                    n, s = self.stats["by_call"].get(name, (0, 0.0))
                    self.stats["by_call"][name] = (n + 1, s + dt)
        return wrapped

    def remove(self) -> dict:
        for name in ("set_phase", "enter", "leave", "begin_step", "end_step"):
            self.rec.__dict__.pop(name, None)
        return self.stats


_probe: _Probe | None = None   # in a worker process, while a probe block runs


def _probe_start(worker, stand_ins: bool = False) -> None:
    global _probe
    _probe = _Probe(worker.recorder, stand_ins)


def _probe_stop(worker) -> dict:
    global _probe
    stats, _probe = _probe.remove(), None
    return stats


# -- a DAP client, attached as an IDE attaches -------------------------------------------------------

class _AttachedClient:
    """initialize, attach, setExceptionBreakpoints (an IDE's default: uncaught), configurationDone; then a
    thread reads and drops whatever debugpy sends, so its writes never block on a full socket."""

    def __init__(self, host: str, port: int, timeout_s: float = 60.0):
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._buf, self._seq = b"", 0
        self._request("initialize", {"clientID": "devharness-bench", "adapterID": "debugpy", "pathFormat": "path",
                                     "linesStartAt1": True, "columnsStartAt1": True})
        attach = self._send("attach", {"justMyCode": False, "subProcess": False})
        self._read_until(lambda m: m.get("event") == "initialized")
        self._request("setExceptionBreakpoints", {"filters": ["uncaught"]})
        self._request("configurationDone")
        self._read_until(lambda m: m.get("request_seq") == attach)
        self._sock.settimeout(None)
        self._drain = threading.Thread(target=self._drop_all, name=f"dap-drain-{port}", daemon=True)
        self._drain.start()

    def _send(self, command: str, arguments: dict | None = None) -> int:
        self._seq += 1
        body = json.dumps({"type": "request", "seq": self._seq, "command": command,
                           "arguments": arguments or {}}).encode()
        self._sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return self._seq

    def _request(self, command: str, arguments: dict | None = None) -> None:
        seq = self._send(command, arguments)
        msg = self._read_until(lambda m: m.get("request_seq") == seq)
        if not msg.get("success"):
            raise RuntimeError(f"DAP {command} failed: {msg.get('message')}")

    def _read_until(self, predicate) -> dict:
        while True:
            while b"\r\n\r\n" not in self._buf:
                self._recv()
            body_at = self._buf.index(b"\r\n\r\n") + 4
            length = int(next(h.split(b":")[1] for h in self._buf[:body_at].split(b"\r\n")
                              if h.lower().startswith(b"content-length")))
            while len(self._buf) < body_at + length:
                self._recv()
            msg = json.loads(self._buf[body_at:body_at + length])
            self._buf = self._buf[body_at + length:]
            if predicate(msg):
                return msg

    def _recv(self) -> None:
        chunk = self._sock.recv(65536)
        if not chunk:
            raise ConnectionError("DAP: debugpy closed the connection")
        self._buf += chunk

    def _drop_all(self) -> None:
        with contextlib.suppress(OSError):
            while self._sock.recv(65536):
                pass

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._send("disconnect", {"terminateDebuggee": False})
            self._sock.shutdown(socket.SHUT_RDWR)   # wakes the drain thread's recv
        self._sock.close()
        self._drain.join(5.0)


def _wait_clients_seen(llm, world: int, timeout_s: float = 30.0) -> None:
    """Until every worker's published state says a client is attached (debugpy's own view of it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = llm.engine.core.executor.collective_rpc("get_state")
        if all(s["debugpy"] and s["debugpy"]["client_connected"] for s in states):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"DAP clients attached, but not every one of the {world} workers saw its client")
        time.sleep(0.2)


def _free_port_bases(count: int, width: int) -> list[int]:
    """`count` port bases, each with `width` free ports above it, none overlapping."""
    bases: list[int] = []
    while len(bases) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + width < 65000 and all(abs(base - b) >= width for b in bases) \
                and all(_port_free(base + i) for i in range(width)):
            bases.append(base)
    return bases


def _port_free(port: int) -> bool:
    with socket.socket() as s, contextlib.suppress(OSError):
        s.bind(("127.0.0.1", port))
        return True
    return False
