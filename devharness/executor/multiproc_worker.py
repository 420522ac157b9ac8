"""The mp executor's worker process: read calls from the broadcast channel, run them on a Worker,
answer on a pipe. Also the messages both sides speak (msgspec only: no pickle on the control plane)."""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Union

import msgspec

from devharness.debug import worker_log
from devharness.executor.base import RPC_METHODS
from devharness.executor.shm_channel import ShmBroadcast, ShmHandle

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 5.0       # an idle worker checks that the driver still exists this often


class StepCall(msgspec.Struct, tag="step", array_like=True):
    seq: int
    scheduler_output: msgspec.Raw   # encoded once by the driver; only Worker.execute_model_bytes decodes it


class RpcCall(msgspec.Struct, tag="rpc", array_like=True):
    seq: int
    method: str
    args: list
    ranks: list[int] | None          # None: every rank


class ExitCall(msgspec.Struct, tag="exit", array_like=True):
    pass


class Reply(msgspec.Struct, array_like=True):
    """A worker's answer to call `seq`: an encoded result, or a formatted error naming the worker."""

    seq: int
    rank: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")    # msgpack nil: a non-output rank's step, a failure
    error: str | None = None


encoder = msgspec.msgpack.Encoder()
call_decoder = msgspec.msgpack.Decoder(Union[StepCall, RpcCall, ExitCall])
reply_decoder = msgspec.msgpack.Decoder(Reply)
EXIT = encoder.encode(ExitCall())


def worker_main(config, source, rank: int, max_model_len: int, init_method: str, handle: ShmHandle,
                 reply_conn: Connection, log_level: int) -> None:
    # Ctrl-C reaches the whole process group; the driver decides and shuts the workers down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    p = config.parallel
    tp = p.tensor_parallel_size
    logging.basicConfig(level=log_level, force=True, format=f"[rank {rank} tp {rank % tp} pp {rank // tp} pid "
                                                            "%(process)d] %(levelname)s %(name)s: %(message)s")
    worker_log.capture(config.run_id or f"pid{os.getpid()}", rank)
    import torch   # after the logging set-up, so import-time warnings carry the rank too

    from devharness.worker.worker import Worker
    torch.set_num_threads(p.threads_per_worker or max(1, (os.cpu_count() or 1) // p.world_size))
    worker = Worker(config, source, rank, max_model_len, distributed_init_method=init_method)
    channel = ShmBroadcast.attach(handle, reader_index=rank)
    try:
        _serve(worker, channel, reply_conn)
    except (BrokenPipeError, EOFError):
        logger.warning("the driver went away; exiting")
    finally:
        worker.shutdown()
        channel.close()
    # Interpreter teardown with torch loaded takes most of a second, and everything this process
    # holds is released above; leave at once so shutdown (and a new LLM) is not kept waiting.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve(worker, channel: ShmBroadcast, reply_conn: Connection) -> None:
    rank = worker.info.rank
    parent = multiprocessing.parent_process()
    while True:
        try:
            call = call_decoder.decode(channel.read(timeout_s=PARENT_CHECK_S))
        except TimeoutError:
            if parent is not None and not parent.is_alive():
                logger.warning("the driver died; exiting")
                return
            continue
        if isinstance(call, ExitCall):
            return
        if isinstance(call, StepCall):
            reply = _run(worker, call.seq, "step", worker.execute_model_bytes, bytes(call.scheduler_output))
        elif call.ranks is None or rank in call.ranks:
            if call.method in RPC_METHODS:
                reply = _run(worker, call.seq, call.method, getattr(worker, call.method, None), *call.args)
            else:
                reply = Reply(call.seq, rank, error=f"{worker.identity}: {call.method!r} is not a worker method")
        else:
            continue
        reply_conn.send_bytes(encoder.encode(reply))


def _run(worker, seq: int, what: str, fn, *args) -> Reply:
    rank = worker.info.rank
    try:
        if fn is None:
            raise NotImplementedError(f"Worker has no method {what!r}")
        result = fn(*args)
        if what == "step":   # already encoded, by the output rank only
            return Reply(seq, rank) if result is None else Reply(seq, rank, msgspec.Raw(result))
        return Reply(seq, rank, msgspec.Raw(encoder.encode(result)))
    except Exception as e:
        logger.exception("failed in %s", what)
        return Reply(seq, rank, error=f"{worker.identity} failed in {what}: {type(e).__name__}: {e}\n"
                                      f"{traceback.format_exc()}")


def identity(p, rank: int, pid: int | None = None) -> str:
    tp = p.tensor_parallel_size
    who = f"rank {rank} (tp {rank % tp}, pp {rank // tp}"
    return who + (f", pid {pid})" if pid is not None else ")")
