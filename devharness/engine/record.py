"""Step recording: every step message the workers ran and what the output rank sampled, written as it
happens, so `devharness replay` runs exactly those steps again, without a scheduler.

A recording is a directory:

    manifest.json   {"format": "devharness-steps/1", "versions": {devharness, torch, python, msgspec},
                     "config": the EngineConfig (msgspec builtins), "model": {"name", "arch"},
                     "num_kv_blocks": the KV cache the block ids refer to, "max_model_len"}
    steps.msgpack   one frame per step: a 4-byte big-endian length, then a msgpack RecordedStep,
                    [step message as the workers received it (SchedulerOutput), sampled req ids, tokens]

Frames are appended and flushed step by step: a run that dies leaves every step it finished.
"""
from __future__ import annotations

import json
import platform
import struct
from pathlib import Path

import msgspec

from devharness.config import EngineConfig
from devharness.messages import ModelRunnerOutput, SchedulerOutput

FORMAT = "devharness-steps/1"
MANIFEST, STEPS = "manifest.json", "steps.msgpack"
_HEADER = struct.Struct("!I")
_encoder = msgspec.msgpack.Encoder()


class RecordedStep(msgspec.Struct, array_like=True):
    scheduler_output: SchedulerOutput
    req_ids: list[str]             # what the output rank sampled, in its order
    sampled_token_ids: list[int]


class Recording(msgspec.Struct):
    manifest: dict
    config: EngineConfig           # the manifest's, loaded
    steps: list[RecordedStep]


def versions() -> dict:
    import torch

    from devharness import __version__
    return {"devharness": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "msgspec": msgspec.__version__}


def model_identity(source) -> dict:
    """Its name and architecture, as the manifest's JSON holds them (so the two compare equal)."""
    return json.loads(msgspec.json.encode({"name": source.name, "arch": source.arch}))


class StepRecorder:
    """Writes one recording; `record` after each executed step."""

    def __init__(self, directory: str | Path, config: EngineConfig, source, num_kv_blocks: int, max_model_len: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        if (self.dir / STEPS).exists():
            raise ValueError(f"--record {self.dir}: already holds a recording; name a new directory")
        manifest = {"format": FORMAT, "versions": versions(), "config": msgspec.to_builtins(config),
                    "model": model_identity(source), "num_kv_blocks": num_kv_blocks, "max_model_len": max_model_len}
        (self.dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        self._file = open(self.dir / STEPS, "ab")

    def record(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        frame = _encoder.encode(RecordedStep(so, out.req_ids, out.sampled_token_ids))
        self._file.write(_HEADER.pack(len(frame)) + frame)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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
    data = (d / STEPS).read_bytes()
    decoder = msgspec.msgpack.Decoder(RecordedStep)
    steps, pos = [], 0
    while pos < len(data):
        if pos + _HEADER.size > len(data):
            raise ValueError(f"{d / STEPS}: truncated after step {len(steps)} (a partial frame header)")
        (n,) = _HEADER.unpack_from(data, pos)
        body = data[pos + _HEADER.size: pos + _HEADER.size + n]
        if len(body) < n:
            raise ValueError(f"{d / STEPS}: truncated in step {len(steps) + 1} ({len(body)} of {n} bytes)")
        try:
            steps.append(decoder.decode(body))
        except msgspec.DecodeError as e:
            raise ValueError(f"{d / STEPS}: step {len(steps) + 1} does not decode ({e})") from None
        pos += _HEADER.size + n
    try:
        config = msgspec.convert(manifest.get("config"), EngineConfig)
    except (msgspec.ValidationError, TypeError) as e:
        raise ValueError(f"{d / MANIFEST}: its engine config does not load ({e})") from None
    return Recording(manifest, config, steps)
