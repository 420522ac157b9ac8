"""Step recording: every step message the workers ran and what the output rank sampled, so
`devharness replay` runs exactly those steps again, without a scheduler. Two writers, one format:

- StepRecorder (`--record DIR`): every step, appended and flushed as it happens (a run that dies
  leaves every step it finished);
- FlightRecorder (always on): the last K steps in memory, written into a bundle (diagnostics/bundle.py)
  on a worker exception, a hang or on demand.

The recording format (the files, the manifest, the reader) is the wire's: protocol/recording.py and
docs/formats.md. A step that did not finish in the recorded run carries its error and the error's kind: a worker
raised in it (FAILED) or it was still running when the bundle was written (UNFINISHED, a hang).
"""
from __future__ import annotations

import collections
import json
import platform
import threading
from pathlib import Path

import msgspec

from devharness.config import EngineConfig
from devharness.protocol.messages import NewRequest, SchedulerOutput, WeightFormat
from devharness.protocol.recording import FAILED, FORMAT, UNFINISHED, Manifest, RecordedStep, StepsWriter

FLIGHT_STEPS = EngineConfig().flight_steps   # the flight_steps option's default


def versions() -> dict:
    import torch

    from devharness import __version__
    return {"devharness": __version__, "torch": str(torch.__version__), "python": platform.python_version(),
            "msgspec": msgspec.__version__}


def model_identity(source) -> dict:
    """Its name and architecture, as the manifest's JSON holds them (so the two compare equal)."""
    return json.loads(msgspec.json.encode({"name": source.name, "arch": source.arch}))


def kernels_identity(config: EngineConfig) -> dict:
    """The kernels a run's logits came from: the backend, dtype, device and, per op, custom or library."""
    from devharness.kernels import kernels_for
    m = config.model
    ops = kernels_for(m.kernels, "cuda" if m.device.startswith("cuda") else "cpu").choices
    return {"backend": m.kernels, "dtype": m.dtype, "device": m.device, "ops": ops}


def make_manifest(config: EngineConfig, source, num_kv_blocks: int, max_model_len: int,
                  partial: bool = False, weights: WeightFormat | None = None) -> Manifest:
    return Manifest(format=FORMAT, versions=versions(), config=config, model=model_identity(source),
                    kernels=kernels_identity(config), weights=weights, num_kv_blocks=num_kv_blocks,
                    max_model_len=max_model_len, partial=partial)


class StepRecorder:
    """Writes one recording; `record` after each executed step."""

    def __init__(self, directory: str | Path, config: EngineConfig, source, num_kv_blocks: int, max_model_len: int,
                 weights: WeightFormat | None = None):
        self.dir = Path(directory)
        self._writer = StepsWriter(self.dir, make_manifest(config, source, num_kv_blocks, max_model_len,
                                                           weights=weights))

    def record(self, step: RecordedStep) -> None:
        self._writer.write(step)

    def close(self) -> None:
        self._writer.close()


class _Held(msgspec.Struct):
    """A request as the workers hold it between steps (what model_runner.RequestState is built from)."""

    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    new: NewRequest


class FlightRecorder:
    """The last `capacity` steps, in memory, always on: a step costs one deque append (the step message and
    output are kept as they are, not encoded); the step that falls out of the window is applied to the
    requests the workers held before the window, so the window can be replayed from an empty KV cache.
    `begin` before a step runs and `end`/`fail` after, on the engine's thread; `window` from any thread.
    With batches in flight several steps have begun; they end in the order they began."""

    def __init__(self, capacity: int = FLIGHT_STEPS):
        self.capacity = capacity
        self._steps: collections.deque[RecordedStep] = collections.deque()
        self._held: dict[str, _Held] = {}
        self._running: list[SchedulerOutput] = []   # begun, not ended: oldest first
        self._lock = threading.Lock()
        self.num_steps = 0           # steps seen

    def begin(self, so: SchedulerOutput) -> None:
        with self._lock:
            self._running.append(so)

    def end(self, step: RecordedStep) -> None:
        with self._lock:
            self._running = [so for so in self._running if so is not step.scheduler_output]
            self._steps.append(step)
            self.num_steps += 1
            if len(self._steps) > self.capacity:
                self._forget(self._steps.popleft().scheduler_output)

    def fail(self, so: SchedulerOutput, error: str) -> None:
        self.end(RecordedStep.ended(so, FAILED, error))

    def _forget(self, so: SchedulerOutput) -> None:
        held = self._held
        for rid in so.finished_req_ids:
            held.pop(rid, None)
        for r in so.new_requests:
            held[r.req_id] = _Held(list(r.token_ids), r.num_prompt_tokens, list(r.block_ids), r.num_computed_tokens, r)
        for c in so.cached_requests:
            h = held.get(c.req_id)
            if h is not None:
                h.token_ids.extend(c.new_token_ids)
                h.block_ids.extend(c.new_block_ids)
                h.num_computed_tokens = c.num_computed_tokens

    def window(self, running_note: str = "still running when the bundle was written") \
            -> tuple[list[NewRequest], list[RecordedStep], bool]:
        """(requests held before the first step, the steps, whether steps start mid-run); steps still
        running come last, marked UNFINISHED."""
        with self._lock:
            steps = list(self._steps)
            running = list(self._running)
            held = [msgspec.structs.replace(h.new, token_ids=list(h.token_ids), block_ids=list(h.block_ids),
                                            num_computed_tokens=h.num_computed_tokens)
                    for h in self._held.values()]
            partial = self.num_steps > len(steps)
        steps += [RecordedStep.ended(so, UNFINISHED, running_note) for so in running]
        return held, steps, partial
