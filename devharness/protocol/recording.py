"""The recording format on disk: a recording is a directory of

    manifest.json   a Manifest (JSON): what the steps ran on
    steps.msgpack   one frame per step: a 4-byte big-endian length (frames.LENGTH), then a msgpack RecordedStep
    held.msgpack    partial recordings only: the requests the workers held before the first step
                    (a msgpack list of NewRequest, as the workers had built them from earlier steps)

Here are the names, the schema, the reader and the writers' encoding; engine/record.py decides what is recorded and
when. docs/formats.md describes the files.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import msgspec

from devharness.config import EngineConfig
from devharness.protocol.frames import LENGTH, encode, length_prefixed
from devharness.protocol.messages import ModelRunnerOutput, NewRequest, SchedulerOutput, WeightFormat

FORMAT = "devharness-steps/2"
# Read too: the format before steps carried their error's kind (their error's text began with it).
FORMAT_1 = "devharness-steps/1"
MANIFEST, STEPS, HELD = "manifest.json", "steps.msgpack", "held.msgpack"

# How a recorded step did not finish: a worker raised in it, or it was still running when the bundle was written.
FAILED, UNFINISHED = "failed", "unfinished"
ErrorKind = Literal["failed", "unfinished"]


class RecordedStep(msgspec.Struct, array_like=True):
    scheduler_output: SchedulerOutput
    req_ids: list[str]             # what the output rank sampled, in its order
    sampled_token_ids: list[int]
    logits_digest: list[tuple[float, float]] | None = None   # (max logit, logsumexp) per sampled row
    error: str | None = None       # the step did not finish: what happened, in words
    error_kind: ErrorKind | None = None   # set with `error`: FAILED or UNFINISHED

    @classmethod
    def of(cls, so: SchedulerOutput, out: ModelRunnerOutput) -> "RecordedStep":
        return cls(so, out.req_ids, out.sampled_token_ids, out.logits_digest)

    @classmethod
    def ended(cls, so: SchedulerOutput, kind: ErrorKind, error: str) -> "RecordedStep":
        """A step that did not finish: nothing was sampled."""
        return cls(so, [], [], None, error, kind)


class Manifest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """manifest.json. `model`: {"name", "arch"}, the model's name and ModelArch; `kernels`: {"backend", "dtype",
    "device", "ops": {op: "custom" | "library"}}, what computed the recorded logits (None: made before recordings
    said); `weights`: how the workers held the weights (WeightFormat: as shipped in a GGUF file's quantized blocks,
    dequantized or float; None: made before recordings said); `num_kv_blocks`: the KV cache the block ids refer to;
    `partial`: the steps start mid-run (a flight recorder's window)."""

    format: str                         # FORMAT (FORMAT_1 is read too)
    versions: dict[str, str] = {}       # devharness, torch, python, msgspec
    config: EngineConfig
    model: dict = {}
    kernels: dict | None = None
    weights: WeightFormat | None = None
    num_kv_blocks: int
    max_model_len: int
    partial: bool = False


class Recording(msgspec.Struct):
    manifest: Manifest
    steps: list[RecordedStep]
    held: list[NewRequest] = []    # partial recordings: what the workers held before steps[0]

    @property
    def config(self) -> EngineConfig:
        return self.manifest.config

    @property
    def partial(self) -> bool:
        return self.manifest.partial


step_decoder = msgspec.msgpack.Decoder(RecordedStep)
held_decoder = msgspec.msgpack.Decoder(list[NewRequest])
manifest_decoder = msgspec.json.Decoder(Manifest)


def frame(step: RecordedStep) -> bytes:
    return length_prefixed(encode(step))


def manifest_json(manifest: Manifest) -> str:
    return json.dumps(msgspec.to_builtins(manifest), indent=1) + "\n"


def write_recording(directory: Path, manifest: Manifest, steps: list[RecordedStep], held: list[NewRequest]) -> None:
    """A whole recording at once (a bundle's steps)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).write_text(manifest_json(manifest))
    (directory / STEPS).write_bytes(b"".join(map(frame, steps)))
    if manifest.partial:
        (directory / HELD).write_bytes(encode(held))


class StepsWriter:
    """A recording written a step at each `write`, flushed as it goes (a run that dies leaves every step it
    finished). A directory that holds a recording already is refused (ValueError)."""

    def __init__(self, directory: Path, manifest: Manifest):
        if (directory / STEPS).exists():
            raise ValueError(f"--record {directory}: already holds a recording; name a new directory")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / MANIFEST).write_text(manifest_json(manifest))
        self._file = open(directory / STEPS, "ab")

    def write(self, step: RecordedStep) -> None:
        self._file.write(frame(step))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _from_format_1(step: RecordedStep) -> RecordedStep:
    """A devharness-steps/1 step: its error text was `<kind>: <what happened>`."""
    if step.error is None:
        return step
    kind, sep, text = step.error.partition(": ")
    if not sep or kind not in (FAILED, UNFINISHED):
        raise ValueError(f"step {step.scheduler_output.step}'s error does not begin with 'failed: ' or "
                         f"'unfinished: ' ({step.error.splitlines()[0][:80]!r})")
    return msgspec.structs.replace(step, error=text, error_kind=kind)


def read_frames(data: bytes, path: Path | str) -> list[RecordedStep]:
    """Every step of a steps file's bytes; ValueError (one line, naming `path`) where it is truncated or a step
    does not decode."""
    steps, pos = [], 0
    while pos < len(data):
        if pos + LENGTH.size > len(data):
            raise ValueError(f"{path}: truncated after step {len(steps)} (a partial frame header)")
        (n,) = LENGTH.unpack_from(data, pos)
        body = data[pos + LENGTH.size: pos + LENGTH.size + n]
        if len(body) < n:
            raise ValueError(f"{path}: truncated in step {len(steps) + 1} ({len(body)} of {n} bytes)")
        try:
            steps.append(step_decoder.decode(body))
        except msgspec.DecodeError as e:
            raise ValueError(f"{path}: step {len(steps) + 1} does not decode ({e})") from None
        pos += LENGTH.size + n
    return steps


def read_recording(directory: str | Path) -> Recording:
    """The recording in `directory` (this format or devharness-steps/1); ValueError (one line) when it is missing,
    truncated or not one."""
    d = Path(directory)
    if not (d / MANIFEST).is_file():
        raise ValueError(f"{d}: no recording here (no {MANIFEST})")
    raw = (d / MANIFEST).read_bytes()
    try:
        fmt = msgspec.json.decode(raw).get("format")   # untyped: only to say which format this claims to be
    except (msgspec.DecodeError, AttributeError) as e:
        raise ValueError(f"{d / MANIFEST}: not a JSON object ({e})") from None
    if fmt not in (FORMAT, FORMAT_1):
        raise ValueError(f"{d / MANIFEST}: not a {FORMAT} recording")
    try:
        manifest = manifest_decoder.decode(raw)
    except msgspec.DecodeError as e:
        raise ValueError(f"{d / MANIFEST}: does not load ({e})") from None
    if not (d / STEPS).is_file():
        raise ValueError(f"{d}: the recording has no {STEPS}")
    steps = read_frames((d / STEPS).read_bytes(), d / STEPS)
    if fmt == FORMAT_1:
        try:
            steps = [_from_format_1(s) for s in steps]
        except ValueError as e:
            raise ValueError(f"{d / STEPS}: {e}") from None
    held = []
    if manifest.partial:
        try:
            held = held_decoder.decode((d / HELD).read_bytes())
        except OSError:
            raise ValueError(f"{d}: a partial recording without {HELD} (the requests held before its first step)") \
                from None
        except msgspec.DecodeError as e:
            raise ValueError(f"{d / HELD}: does not decode ({e})") from None
    return Recording(manifest, steps, held)
