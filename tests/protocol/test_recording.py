"""The recording format (protocol/recording.py) without an engine: what the writers put on disk is what the reader
gives back, a step that did not finish carries its error's kind, and a recording of the format before kinds
(devharness-steps/1, the kind at the head of the error's text) is still read."""
import json

import msgspec
import pytest

from devharness.config import EngineConfig
from devharness.protocol.frames import LENGTH, encode
from devharness.protocol.messages import NewRequest, SchedulerOutput
from devharness.protocol.recording import (FAILED, FORMAT, FORMAT_1, HELD, MANIFEST, STEPS, UNFINISHED, Manifest,
                                           RecordedStep, StepsWriter, read_recording, write_recording)
from devharness.sampling_params import SamplingParams


def _manifest(**kw) -> Manifest:
    return Manifest(**{"format": FORMAT, "versions": {"devharness": "0"}, "config": EngineConfig(),
                       "model": {"name": "tiny-llama"}, "num_kv_blocks": 24, "max_model_len": 256, **kw})


def _so(step: int) -> SchedulerOutput:
    return SchedulerOutput(step, [], [], {"r": 1}, [])


STEPS_OF_A_RUN = [RecordedStep(_so(1), ["r"], [7], [(1.5, 2.5)]),
                  RecordedStep.ended(_so(2), FAILED, "WorkerError: step 2: rank 1 raised"),
                  RecordedStep.ended(_so(3), UNFINISHED, "still running when the bundle was written")]


def test_a_partial_recording_reads_back_as_written(tmp_path):
    held = [NewRequest("r", [1, 2, 3], 3, [0], 3, SamplingParams(max_tokens=4), 11)]
    write_recording(tmp_path, _manifest(partial=True), STEPS_OF_A_RUN, held)
    rec = read_recording(tmp_path)
    assert rec.steps == STEPS_OF_A_RUN and rec.held == held and rec.partial
    assert rec.config == EngineConfig() and rec.manifest.num_kv_blocks == 24
    assert [(s.error_kind, s.error) for s in rec.steps] == [
        (None, None), ("failed", "WorkerError: step 2: rank 1 raised"),
        ("unfinished", "still running when the bundle was written")]
    on_disk = json.loads((tmp_path / MANIFEST).read_text())
    assert on_disk["format"] == "devharness-steps/2" and on_disk["partial"] is True and "kernels" not in on_disk
    # The kind is the step array's sixth element.
    data = (tmp_path / STEPS).read_bytes()
    (n,) = LENGTH.unpack_from(data)
    assert msgspec.msgpack.decode(data[LENGTH.size:LENGTH.size + n])[4:] == [None, None]
    last = data[LENGTH.size + n:]
    (m,) = LENGTH.unpack_from(last)
    assert msgspec.msgpack.decode(last[LENGTH.size:LENGTH.size + m])[4:] == ["WorkerError: step 2: rank 1 raised",
                                                                           "failed"]


def test_the_step_writer_appends_and_refuses_a_second_recording(tmp_path):
    w = StepsWriter(tmp_path / "rec", _manifest())
    for s in STEPS_OF_A_RUN[:2]:
        w.write(s)
    w.close()
    rec = read_recording(tmp_path / "rec")
    assert rec.steps == STEPS_OF_A_RUN[:2] and not rec.partial and rec.held == []
    with pytest.raises(ValueError, match="already holds a recording"):
        StepsWriter(tmp_path / "rec", _manifest())


def _format_1(d, errors: list[str | None]):
    """A recording as devharness-steps/1 wrote it: five-element steps, the kind at the head of the error."""
    d.mkdir()
    manifest = msgspec.to_builtins(_manifest(format=FORMAT_1))
    (d / MANIFEST).write_text(json.dumps(manifest))
    frames = [encode([msgspec.to_builtins(_so(i + 1)), [], [], None, e]) for i, e in enumerate(errors)]
    (d / STEPS).write_bytes(b"".join(LENGTH.pack(len(f)) + f for f in frames))


def test_a_format_1_recording_is_read_with_its_kinds(tmp_path):
    _format_1(tmp_path / "old", [None, "failed: WorkerError: step 2: boom", "unfinished: still running"])
    rec = read_recording(tmp_path / "old")
    assert rec.manifest.format == FORMAT_1
    assert [(s.error_kind, s.error) for s in rec.steps] == [
        (None, None), ("failed", "WorkerError: step 2: boom"), ("unfinished", "still running")]


def test_bad_recordings_are_refused_with_one_line(tmp_path):
    _format_1(tmp_path / "nokind", [None, "boom"])
    with pytest.raises(ValueError, match=r"steps.msgpack: step 2's error does not begin with 'failed: '"):
        read_recording(tmp_path / "nokind")
    write_recording(tmp_path / "badkind", _manifest(), STEPS_OF_A_RUN, [])
    data = (tmp_path / "badkind" / STEPS).read_bytes().replace(b"\xa6failed", b"\xa6Failed")
    (tmp_path / "badkind" / STEPS).write_bytes(data)
    with pytest.raises(ValueError, match=r"step 2 does not decode"):
        read_recording(tmp_path / "badkind")
    write_recording(tmp_path / "nosize", _manifest(), STEPS_OF_A_RUN, [])
    manifest = json.loads((tmp_path / "nosize" / MANIFEST).read_text())
    del manifest["num_kv_blocks"]
    (tmp_path / "nosize" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"manifest.json: does not load .*num_kv_blocks"):
        read_recording(tmp_path / "nosize")
    (tmp_path / "nosize" / MANIFEST).write_text(json.dumps({**manifest, "format": "devharness-steps/9"}))
    with pytest.raises(ValueError, match=r"not a devharness-steps/2 recording"):
        read_recording(tmp_path / "nosize")
    write_recording(tmp_path / "noheld", _manifest(partial=True), STEPS_OF_A_RUN, [])
    (tmp_path / "noheld" / HELD).unlink()
    with pytest.raises(ValueError, match="a partial recording without held.msgpack"):
        read_recording(tmp_path / "noheld")
