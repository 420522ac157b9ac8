"""The mp executor's worker process: set up logging and threads, build the Worker, and run the worker
loop (worker/worker_loop.py) on the driver's message queue, answering on a pipe."""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
from multiprocessing.connection import Connection

from devharness.debug import worker_log
from devharness.distributed.message_queue import QueueHandle, WorkerEnd
from devharness.distributed.rendezvous import Rendezvous

logger = logging.getLogger(__name__)


def worker_main(config, source, rank: int, max_model_len: int, rendezvous: Rendezvous, handle: QueueHandle,
                 reply_conn: Connection, log_level: int, environ: dict[str, str] | None = None) -> None:
    # Ctrl-C reaches the whole process group; the driver decides and shuts the workers down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if environ is not None:   # the driver's, now: the forkserver we were forked from kept its own from its start
        os.environ.clear()
        os.environ.update(environ)
    p = config.parallel
    tp = p.tensor_parallel_size
    logging.basicConfig(level=log_level, force=True, format=f"[rank {rank} tp {rank % tp} pp {rank // tp} pid "
                                                            "%(process)d] %(levelname)s %(name)s: %(message)s")
    worker_log.capture(config.run_id or f"pid{os.getpid()}", rank)
    import torch   # preloaded by the executor's forkserver; else imported here, after the logging set-up

    from devharness.worker.worker import Worker
    from devharness.worker.worker_loop import serve
    torch.set_num_threads(p.threads_per_worker or max(1, (os.cpu_count() or 1) // p.world_size))
    worker = Worker(config, source, rank, max_model_len, rendezvous=rendezvous)
    calls = WorkerEnd(handle, rank)
    parent = multiprocessing.parent_process()
    try:
        serve(worker, calls, reply_conn.send_bytes, answer_every_step=True,
              driver_alive=lambda: parent is None or parent.is_alive())
    except (BrokenPipeError, EOFError):
        logger.warning("the driver went away; exiting")
    finally:
        worker.shutdown()
        calls.close()
    # Interpreter teardown with torch loaded takes most of a second, and everything this process
    # holds is released above; leave at once so shutdown (and a new LLM) is not kept waiting.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def identity(p, rank: int, pid: int | None = None) -> str:
    tp = p.tensor_parallel_size
    who = f"rank {rank} (tp {rank % tp}, pp {rank // tp}"
    return who + (f", pid {pid})" if pid is not None else ")")
