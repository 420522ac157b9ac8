"""The recording format on disk (engine/record.py writes and reads the files): `steps.msgpack` is a run of frames,
each a 4-byte big-endian length and a msgpack RecordedStep (the step message as the workers received it, and what
the output rank sampled). docs/formats.md describes the files around it."""
from __future__ import annotations

import struct
from pathlib import Path

import msgspec

from devharness.protocol.frames import encode
from devharness.protocol.messages import ModelRunnerOutput, SchedulerOutput

FORMAT = "devharness-steps/1"
_HEADER = struct.Struct("!I")


class RecordedStep(msgspec.Struct, array_like=True):
    scheduler_output: SchedulerOutput
    req_ids: list[str]             # what the output rank sampled, in its order
    sampled_token_ids: list[int]
    logits_digest: list[tuple[float, float]] | None = None   # (max logit, logsumexp) per sampled row
    error: str | None = None       # the step did not finish: "failed: ..." / "unfinished: ..."

    @classmethod
    def of(cls, so: SchedulerOutput, out: ModelRunnerOutput) -> "RecordedStep":
        return cls(so, out.req_ids, out.sampled_token_ids, out.logits_digest)


step_decoder = msgspec.msgpack.Decoder(RecordedStep)


def frame(step: RecordedStep) -> bytes:
    body = encode(step)
    return _HEADER.pack(len(body)) + body


def read_frames(data: bytes, path: Path | str) -> list[RecordedStep]:
    """Every step of a steps file's bytes; ValueError (one line, naming `path`) where it is truncated or a step
    does not decode."""
    steps, pos = [], 0
    while pos < len(data):
        if pos + _HEADER.size > len(data):
            raise ValueError(f"{path}: truncated after step {len(steps)} (a partial frame header)")
        (n,) = _HEADER.unpack_from(data, pos)
        body = data[pos + _HEADER.size: pos + _HEADER.size + n]
        if len(body) < n:
            raise ValueError(f"{path}: truncated in step {len(steps) + 1} ({len(body)} of {n} bytes)")
        try:
            steps.append(step_decoder.decode(body))
        except msgspec.DecodeError as e:
            raise ValueError(f"{path}: step {len(steps) + 1} does not decode ({e})") from None
        pos += _HEADER.size + n
    return steps
