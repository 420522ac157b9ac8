"""The frames both sides of a step channel speak, the length prefix that delimits a frame on a byte stream, and the
codecs of everything that crosses a process boundary as msgpack: one encoder, one decoder per type
(tests/test_layout.py holds every other module to using these)."""
from __future__ import annotations

import functools
import struct
from typing import Union

import msgspec

from devharness.protocol.messages import ControlCall, ModelRunnerOutput, SchedulerOutput, WorkerState


class StepCall(msgspec.Struct, tag="step", array_like=True):
    seq: int
    scheduler_output: msgspec.Raw   # encoded once by the driver; only the worker's step decodes it


class ControlFrame(msgspec.Struct, tag="control", array_like=True):
    seq: int
    call: ControlCall                # typed (messages.py): a worker decodes only the calls it answers
    ranks: list[int] | None          # None: every rank


class ExitCall(msgspec.Struct, tag="exit", array_like=True):
    pass


class Reply(msgspec.Struct, array_like=True):
    """A worker's answer to call `seq`: an encoded result, or a formatted error naming the worker."""

    seq: int
    rank: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")    # msgpack nil: a non-output rank's step, a failure
    error: str | None = None


class Hello(msgspec.Struct, frozen=True):
    """A worker's first frame on a TCP step channel: which rank it is and the executor's token."""

    rank: int
    token: bytes


# A frame on a byte stream (a TCP step channel, a recording's steps file): this 4-byte big-endian length, then that
# many bytes of msgpack.
LENGTH = struct.Struct("!I")


def length_prefixed(body: bytes) -> bytes:
    return LENGTH.pack(len(body)) + body


encoder = msgspec.msgpack.Encoder()
encode = encoder.encode
EXIT = encode(ExitCall())

# One decoder per type.
call_decoder = msgspec.msgpack.Decoder(Union[StepCall, ControlFrame, ExitCall])
reply_decoder = msgspec.msgpack.Decoder(Reply)
hello_decoder = msgspec.msgpack.Decoder(Hello)
control_decoder = msgspec.msgpack.Decoder(ControlCall)
step_decoder = msgspec.msgpack.Decoder(SchedulerOutput)
output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
state_decoder = msgspec.msgpack.Decoder(WorkerState)


@functools.lru_cache(maxsize=None)
def reply_value_decoder(call_type: type) -> msgspec.msgpack.Decoder:
    """The decoder of a control call's answer: the type the call declares (`Reply`)."""
    return msgspec.msgpack.Decoder(call_type.Reply)
