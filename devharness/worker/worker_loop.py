"""The one loop a worker runs, in an mp child process or a Ray actor: read a call from the driver's
message queue, run it on the Worker, answer, in the frames of protocol/frames.py (msgspec only: no
pickle on the control plane).

What differs between backends is only where answers go and how a failure is told:
- mp: every rank answers every call on its pipe (a rank that never answers a step is named as hung),
  and an error is an answer naming the rank.
- Ray: only the output rank answers a step (on a ring or its TCP connection), and with the KV sanitizer every
  rank does (a KV checksum alarm may come from any rank, and the driver must know that none did before it ends
  the step: debug/kv_checksums.py); any other failure ends the loop with the exception, and the loop's ObjectRef
  (Ray's liveness) names the rank.

Calls run in the order the driver wrote them, which may be several at a time (batches in flight): a
pipeline stage reads step i+1 as soon as it has sent step i's activations on, while the next stage
still runs step i.
"""
from __future__ import annotations

import logging
import traceback
from typing import Callable

import msgspec

from devharness.distributed.message_queue import WorkerEnd
from devharness.protocol.frames import ExitCall, Reply, StepCall, call_decoder, encoder

logger = logging.getLogger(__name__)

IDLE_CHECK_S = 5.0   # an idle worker asks `driver_alive` this often

def serve(worker, calls: WorkerEnd, answer: Callable[[bytes], None] | None, *, answer_every_step: bool,
          driver_alive: Callable[[], bool] | None = None) -> int:
    """Run calls until ExitCall (or `driver_alive()` turns false while idle); returns the steps run.

    `answer`: where replies go; None for a rank that answers no step (a failure then raises).
    `answer_every_step`: a failed step is an answer naming the rank, not the end of the loop."""
    rank = worker.info.rank
    steps = 0
    while True:
        try:
            call = call_decoder.decode(calls.read(IDLE_CHECK_S))
        except TimeoutError:
            if driver_alive is not None and not driver_alive():
                logger.warning("the driver died; exiting")
                return steps
            continue
        if isinstance(call, ExitCall):
            return steps
        if isinstance(call, StepCall):
            steps += 1
            if answer_every_step:
                reply = run_call(worker, call.seq, "step", worker.execute_model_bytes, bytes(call.scheduler_output))
            else:   # a failure ends the loop: the backend names the rank
                result = worker.execute_model_bytes(bytes(call.scheduler_output))
                if answer is None:
                    continue
                reply = Reply(call.seq, rank) if result is None else Reply(call.seq, rank, msgspec.Raw(result))
        elif call.ranks is None or rank in call.ranks:
            reply = run_call(worker, call.seq, call.call.__struct_config__.tag, worker.control, call.call)
        else:
            continue
        answer(encoder.encode(reply))


def run_call(worker, seq: int, what: str, fn, *args) -> Reply:
    rank = worker.info.rank
    try:
        result = fn(*args)
        if what == "step":   # already encoded, by the output rank only
            return Reply(seq, rank) if result is None else Reply(seq, rank, msgspec.Raw(result))
        return Reply(seq, rank, msgspec.Raw(encoder.encode(result)))
    except Exception as e:
        logger.exception("failed in %s", what)
        return Reply(seq, rank, error=f"{worker.identity} failed in {what}: {type(e).__name__}: {e}\n"
                                      f"{traceback.format_exc()}")
