"""Step recording: every step message the workers ran and what the output rank sampled, so
`devharness replay` runs exactly those steps again, without a scheduler. Two writers, one format:

- StepRecorder (`--record DIR`): every step, appended and flushed as it happens (a run that dies
  leaves every step it finished);
- FlightRecorder (always on): the last K steps in memory, written into a bundle (monitor/bundle.py)
  on a worker exception, a hang or on demand.

A recording is a directory:

    manifest.json   {"format": "devharness-steps/1", "versions": {devharness, torch, python, msgspec},
                     "config": the EngineConfig (msgspec builtins), "model": {"name", "arch"},
                     "kernels": {"backend", "dtype", "device", "ops": {op: "custom" | "library"}}: what computed
                     the recorded logits (a replay runs them by default and says when it runs others),
                     "num_kv_blocks": the KV cache the block ids refer to, "max_model_len",
                     "partial": true when the steps start mid-run (a flight recorder's window)}
    steps.msgpack   one frame per step: a 4-byte big-endian length, then a msgpack RecordedStep,
                    [step message as the workers received it (SchedulerOutput), sampled req ids, tokens,
                     each sampled row's (max logit, logsumexp) or null, the step's error or null]
    held.msgpack    partial recordings only: the requests the workers held before the first step
                    (a msgpack list of NewRequest, as the workers had built them from earlier steps)

A step whose error is set did not finish in the recorded run: a worker raised ("failed: ...") or it
was still running when the bundle was written ("unfinished: ...", a hang).
"""
from __future__ import annotations

import collections
import json
import platform
import threading
from pathlib import Path

import msgspec

from devharness.config import EngineConfig
from devharness.protocol.frames import encode, held_decoder
from devharness.protocol.messages import NewRequest, SchedulerOutput
from devharness.protocol.recording import FORMAT, RecordedStep, frame, read_frames

MANIFEST, STEPS, HELD = "manifest.json", "steps.msgpack", "held.msgpack"
FLIGHT_STEPS = EngineConfig().flight_steps   # the flight_steps option's default


class Recording(msgspec.Struct):
    manifest: dict
    config: EngineConfig           # the manifest's, loaded
    steps: list[RecordedStep]
    held: list[NewRequest] = []    # partial recordings: what the workers held before steps[0]

    @property
    def partial(self) -> bool:
        return bool(self.manifest.get("partial"))


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


def make_manifest(config: EngineConfig, source, num_kv_blocks: int, max_model_len: int, partial: bool = False) -> dict:
    manifest = {"format": FORMAT, "versions": versions(), "config": msgspec.to_builtins(config),
                "model": model_identity(source), "kernels": kernels_identity(config), "num_kv_blocks": num_kv_blocks,
                "max_model_len": max_model_len}
    if partial:
        manifest["partial"] = True
    return manifest


class StepRecorder:
    """Writes one recording; `record` after each executed step."""

    def __init__(self, directory: str | Path, config: EngineConfig, source, num_kv_blocks: int, max_model_len: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        if (self.dir / STEPS).exists():
            raise ValueError(f"--record {self.dir}: already holds a recording; name a new directory")
        manifest = make_manifest(config, source, num_kv_blocks, max_model_len)
        (self.dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        self._file = open(self.dir / STEPS, "ab")

    def record(self, step: RecordedStep) -> None:
        self._file.write(frame(step))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_recording(directory: Path, manifest: dict, steps: list[RecordedStep], held: list[NewRequest]) -> None:
    """A whole recording at once (a bundle's steps)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (directory / STEPS).write_bytes(b"".join(map(frame, steps)))
    if manifest.get("partial"):
        (directory / HELD).write_bytes(encode(held))


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
        self.end(RecordedStep(so, [], [], None, f"failed: {error}"))

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

    def window(self, running_note: str = "unfinished: still running when the bundle was written") \
            -> tuple[list[NewRequest], list[RecordedStep], bool]:
        """(requests held before the first step, the steps, whether steps start mid-run); steps still
        running come last, marked unfinished."""
        with self._lock:
            steps = list(self._steps)
            running = list(self._running)
            held = [msgspec.structs.replace(h.new, token_ids=list(h.token_ids), block_ids=list(h.block_ids),
                                            num_computed_tokens=h.num_computed_tokens)
                    for h in self._held.values()]
            partial = self.num_steps > len(steps)
        steps += [RecordedStep(so, [], [], None, running_note) for so in running]
        return held, steps, partial


def read_recording(directory: str | Path) -> Recording:
    """The recording in `directory`; ValueError (one line) when it is missing, truncated or not one."""
    d = Path(directory)
    if not (d / MANIFEST).is_file():
        raise ValueError(f"{d}: no recording here (no {MANIFEST})")
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except ValueError as e:
        raise ValueError(f"{d / MANIFEST}: not JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{d / MANIFEST}: not a {FORMAT} recording")
    if not (d / STEPS).is_file():
        raise ValueError(f"{d}: the recording has no {STEPS}")
    steps = read_frames((d / STEPS).read_bytes(), d / STEPS)
    try:
        config = msgspec.convert(manifest.get("config"), EngineConfig)
    except (msgspec.ValidationError, TypeError) as e:
        raise ValueError(f"{d / MANIFEST}: its engine config does not load ({e})") from None
    held = []
    if manifest.get("partial"):
        try:
            held = held_decoder.decode((d / HELD).read_bytes())
        except OSError:
            raise ValueError(f"{d}: a partial recording without {HELD} (the requests held before its first step)") \
                from None
        except msgspec.DecodeError as e:
            raise ValueError(f"{d / HELD}: does not decode ({e})") from None
    return Recording(manifest, config, steps, held)
