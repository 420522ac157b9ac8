"""Worker profilers: what runs around one worker's steps between a StartProfile and a StopProfile control call
(protocol/messages.py), so that every executor carries them (`Executor.control`, `LLMEngine.start_profile`).
A worker runs at most one at a time; it keeps only the hook site (Worker.execute_model hands each step to the
profiler running, if any). The kinds:

- "torch": torch.profiler over every step between start and stop; at stop, one Chrome trace per rank in the
  directory given at start (chrome://tracing or https://ui.perfetto.dev read it), each step marked
  `devharness step N`. Every thread of the worker's process is recorded (a Ray actor answers control calls
  on another thread than its steps).
- "state-ab": the worker's state publishing (debug/state.py: the recorder the runner, the collectives and the
  layers publish to) off on even steps and on on odd ones, the collective ledger on throughout; each step's
  thread CPU time (waits for other ranks and for the driver left out). At stop: pairs of neighbouring steps,
  (off, on), on every rank alike, so that no rank waits for another that publishes.
- "ledger-ab": likewise the collective ledger's observer alone (debug/ledger.py), the recorder on throughout.
- "numerics-ab": likewise the numerics check (debug/numerics.py; one is made for the profile where the engine runs
  without it, and taken away at stop).
- "recorder-calls": this worker's StateRecorder's hot-path methods counted and timed (a call made from inside another
  counts once, with the outer); `stand_ins`: the methods replaced by do-nothing stand-ins, timed alike (what the
  timing itself costs, right after a collective's wait on cold caches).

- "kv-checksums": the thread CPU time of each step, of the KV checksums' one call in it (debug/kv_checksums.py,
  with the KV sanitizer on) and of the runner's check of the blocks' generations, and the blocks the checksums
  took and verified.

`bench debug-overhead` reads all but "torch", which is for a developer's look at a step's ops.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from devharness.distributed import collectives
from devharness.protocol.messages import ProfileCalls, ProfileResult

KINDS = ("torch", "state-ab", "ledger-ab", "recorder-calls", "numerics-ab", "kv-checksums")
RECORDER_METHODS = ("set_phase", "enter", "leave", "begin_step", "end_step")


def check(kind: str, trace_dir: str | None = None, stand_ins: bool = False) -> None:
    """Raise ValueError naming what is wrong with a StartProfile's arguments."""
    if kind not in KINDS:
        raise ValueError(f"profile kind {kind!r}: must be one of {', '.join(KINDS)}")
    if kind == "torch" and not trace_dir:
        raise ValueError("profile kind 'torch' needs trace_dir: the directory its Chrome traces go to")
    if kind != "torch" and trace_dir is not None:
        raise ValueError(f"trace_dir: only the 'torch' profile writes traces, not {kind!r}")
    if stand_ins and kind != "recorder-calls":
        raise ValueError(f"stand_ins: only the 'recorder-calls' profile has stand-ins, not {kind!r}")


def start(worker, kind: str, trace_dir: str | None = None, stand_ins: bool = False) -> "Profiler":
    """A profiler of `kind` running on `worker` (a worker/worker.py Worker) from now on."""
    check(kind, trace_dir, stand_ins)
    if kind == "torch":
        return TorchProfiler(worker, trace_dir)
    if kind == "recorder-calls":
        return RecorderCalls(worker, stand_ins)
    if kind == "kv-checksums":
        return KvChecksumCalls(worker)
    return {"state-ab": StateTurns, "ledger-ab": LedgerTurns, "numerics-ab": NumericsTurns}[kind](worker)


class Profiler:
    """Counts the steps it ran; `step(run, so)` runs one (`run(so)` is the worker's own step)."""

    kind = ""

    def __init__(self, worker):
        self.worker = worker
        self.steps = 0

    def step(self, run, so):
        self.steps += 1
        return run(so)

    def stop(self) -> ProfileResult:
        return ProfileResult(kind=self.kind, rank=self.worker.info.rank, steps=self.steps)


# -- torch.profiler ------------------------------------------------------------------------------------


def _all_threads_config():
    try:
        from torch._C._profiler import _ExperimentalConfig
        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):   # an older torch: the thread that starts it only
        return None


class TorchProfiler(Profiler):
    kind = "torch"

    def __init__(self, worker, trace_dir: str):
        super().__init__(worker)
        import torch
        self.trace_dir = Path(trace_dir)
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        cuda = worker.runner is not None and worker.runner.device.type == "cuda" and torch.cuda.is_available()
        self._record = torch.profiler.record_function
        # autograd's profile, which torch.profiler.profile wraps: the same Kineto trace, without the wrapper's
        # first start importing torch._inductor (seconds, in every worker process).
        self._prof = torch.autograd.profiler.profile(use_kineto=True, use_device="cuda" if cuda else None,
                                                     record_shapes=True, experimental_config=_all_threads_config())
        self._prof.__enter__()

    def step(self, run, so):
        self.steps += 1
        with self._record(f"devharness step {so.step}"):
            return run(so)

    def stop(self) -> ProfileResult:
        self._prof.__exit__(None, None, None)
        i = self.worker.info
        stem = f"devharness-rank{i.rank}-tp{i.tp_rank}-pp{i.pp_rank}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        path, n = self.trace_dir / f"{stem}.pt.trace.json", 1
        while path.exists():   # a second profile within the second
            n += 1
            path = self.trace_dir / f"{stem}-{n}.pt.trace.json"
        self._prof.export_chrome_trace(str(path))
        result = super().stop()
        result.trace = str(path)
        return result


# -- A/B by turns: odd steps with, even steps without ---------------------------------------------------


class _Turns(Profiler):
    def __init__(self, worker):
        super().__init__(worker)
        self._by_step: dict[int, tuple[bool, float]] = {}   # step -> (with it, thread CPU seconds)

    def _switch(self, on: bool) -> None:
        raise NotImplementedError

    def step(self, run, so):
        self.steps += 1
        on = so.step % 2 == 1
        self._switch(on)
        cpu0 = time.thread_time()
        try:
            return run(so)
        finally:
            self._by_step[so.step] = (on, time.thread_time() - cpu0)
            self._switch(True)

    def stop(self) -> ProfileResult:
        by = self._by_step
        result = super().stop()
        result.pairs_us = [(cpu * 1e6, by[s + 1][1] * 1e6) for s, (on, cpu) in sorted(by.items())
                           if not on and s + 1 in by and by[s + 1][0]]
        return result


class StateTurns(_Turns):
    """Off: the runner, the layers and the collectives publish nothing; the ledger stays (ledger-ab measures it)."""
    kind = "state-ab"

    def _switch(self, on: bool) -> None:
        self.worker.publish_state(on)
        self.worker.observers.add(self.worker.ledger)


class LedgerTurns(_Turns):
    kind = "ledger-ab"

    def _switch(self, on: bool) -> None:
        (self.worker.observers.add if on else self.worker.observers.remove)(self.worker.ledger)


class NumericsTurns(_Turns):
    kind = "numerics-ab"

    def __init__(self, worker):
        super().__init__(worker)
        from devharness.debug.numerics import NumericsCheck
        runner = worker.runner
        self._own = runner.numerics   # the engine's check, if it runs with one
        self._check = self._own or NumericsCheck(worker.info)

    def _switch(self, on: bool) -> None:
        runner = self.worker.runner
        runner.numerics = self._check if on else None
        (runner.hooks.install if on else runner.hooks.remove)(self._check)

    def stop(self) -> ProfileResult:
        self._switch(self._own is not None)
        return super().stop()


# -- the recorder's calls, counted and timed ----------------------------------------------------------


def _do_nothing(*args, **kwargs) -> None:
    return None


class RecorderCalls(Profiler):
    """Counts and times this worker's StateRecorder's methods until stop. The recorder has slots, so its class is
    swapped, for this one instance, for a subclass whose methods are the timed ones: another worker's recorder in the
    same process (two engines on `uni`) keeps the plain class and is neither counted nor slowed."""
    kind = "recorder-calls"

    def __init__(self, worker, stand_ins: bool = False):
        super().__init__(worker)
        self.depth = 0
        self.calls = {name: ProfileCalls() for name in RECORDER_METHODS}
        self.recorder = worker.recorder
        plain = type(self.recorder)
        timed = {name: self._wrap(self.calls[name], _do_nothing if stand_ins else getattr(plain, name))
                 for name in RECORDER_METHODS}
        self._plain = plain
        self.recorder.__class__ = type(f"Timed{plain.__name__}", (plain,), {"__slots__": (), **timed})

    def _wrap(self, stat: ProfileCalls, fn):
        clock = time.perf_counter

        def timed(*args, **kwargs):
            self.depth += 1
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if not self.depth:
                    stat.calls += 1
                    stat.seconds += clock() - t0
        return timed

    def stop(self) -> ProfileResult:
        self.recorder.__class__ = self._plain
        result = super().stop()
        result.calls = self.calls
        return result


# -- the KV checksums' share of a step ---------------------------------------------------------------


class KvChecksumCalls(Profiler):
    """Times each step, the KV checksums' call in it and the runner's check of the blocks' generations (their methods
    wrapped on this worker's instances until stop), in thread CPU time: waits for other ranks and the driver are no
    one's cost."""
    kind = "kv-checksums"

    def __init__(self, worker):
        super().__init__(worker)
        self.checks = worker.runner.kv_checksums   # None: the KV sanitizer is off
        self.stats = {"steps": ProfileCalls(), "checksums": ProfileCalls(), "generations": ProfileCalls()}
        self._wrapped: list = []
        if self.checks is not None:
            self._blocks = (self.checks.taken, self.checks.verified)
            self._time(self.checks, "after_step", self.stats["checksums"])
            self._time(worker.runner, "check_kv_generations", self.stats["generations"])

    def _time(self, obj, name: str, stat: ProfileCalls) -> None:
        real = getattr(obj, name)

        def timed(*args):
            cpu0 = time.thread_time()
            try:
                return real(*args)
            finally:
                stat.calls += 1
                stat.seconds += time.thread_time() - cpu0
        setattr(obj, name, timed)
        self._wrapped.append((obj, name))

    def step(self, run, so):
        cpu0 = time.thread_time()
        try:
            return super().step(run, so)
        finally:
            self.stats["steps"].calls += 1
            self.stats["steps"].seconds += time.thread_time() - cpu0

    def stop(self) -> ProfileResult:
        result = super().stop()
        for obj, name in self._wrapped:
            delattr(obj, name)   # the class's method again
        if self.checks is not None:
            taken, verified = self._blocks
            self.stats["blocks checksummed"] = ProfileCalls(self.checks.taken - taken)
            self.stats["blocks verified"] = ProfileCalls(self.checks.verified - verified)
        result.calls = self.stats
        return result
