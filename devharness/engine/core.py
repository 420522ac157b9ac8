"""EngineCore: the scheduler, the KV block budget and the executor, stepped in one loop."""
from __future__ import annotations

import logging
import time
import weakref

import msgspec

from devharness.config import EngineConfig
from devharness.debug.state import remove_run_files
from devharness.engine.record import FlightRecorder, RecordedStep
from devharness.engine.request import Request, RequestStatus
from devharness.engine.scheduler import Scheduler
from devharness.executor.base import Executor
from devharness.messages import InitKvCache, KvCacheBlockBytes, SchedulerOutput
from devharness.model.loader import ModelSource

logger = logging.getLogger(__name__)
_encoder = msgspec.msgpack.Encoder()


class EngineCore:
    """Token-level engine: requests in, sampled tokens out, one `step()` at a time."""

    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int):
        self.config = config
        self.source = source
        self.max_model_len_requested = max_model_len
        try:
            self.executor = Executor.get_class(config.parallel.distributed_executor_backend)(
                config, source, max_model_len)
        except BaseException:   # workers that started and then failed may have left their state files
            remove_run_files(config.run_id)
            raise
        try:
            self.num_kv_blocks = self._size_kv_cache()
            self.executor.control(InitKvCache(self.num_kv_blocks))
            self.recorder = None
            self.flight = FlightRecorder(config.flight_steps) if config.flight_steps else None
            if config.record_dir:
                from devharness.engine.record import StepRecorder
                self.recorder = StepRecorder(config.record_dir, config, source, self.num_kv_blocks,
                                             min(max_model_len, self.num_kv_blocks * config.scheduler.block_size))
        except BaseException:
            self.executor.shutdown()
            remove_run_files(config.run_id)
            raise
        # A request that fills max_model_len must fit in the cache alone, or it could never run.
        self.max_model_len = min(max_model_len, self.num_kv_blocks * config.scheduler.block_size)
        if self.max_model_len < max_model_len:
            logger.warning("KV cache holds %d blocks: max_model_len lowered from %d to %d",
                           self.num_kv_blocks, max_model_len, self.max_model_len)
        self.scheduler = Scheduler(config.scheduler, self.num_kv_blocks)
        # Interpreter exit without shutdown(): the workers' state files go too.
        self._files_finalizer = weakref.finalize(self, remove_run_files, config.run_id)
        self.last_step_ms = 0.0

    def _size_kv_cache(self) -> int:
        sc = self.config.scheduler
        if sc.num_kv_blocks is not None:
            return sc.num_kv_blocks
        # Every worker must fit the same block count; the stage with most layers decides.
        block_bytes = max(self.executor.control(KvCacheBlockBytes()))
        # More blocks than max_num_seqs full-length sequences would never be used: don't allocate them.
        useful = sc.max_num_seqs * -(-self.max_model_len_requested // sc.block_size)
        num = min(sc.kv_cache_memory_bytes // block_bytes, useful)
        if num < 1:
            raise ValueError(f"SchedulerConfig.kv_cache_memory_bytes={sc.kv_cache_memory_bytes} holds no KV block "
                             f"({block_bytes} bytes each); raise it")
        return num

    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)

    def abort_request(self, req_id: str) -> Request | None:
        return self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, req_id: str, status: RequestStatus) -> Request | None:
        return self.scheduler.finish_request(req_id, status)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[tuple]:
        """Schedule, run on every worker, apply the sampled tokens. [(request, token, logprobs)];
        a request that failed on its own comes back as (request, None, None) with its error set."""
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        failed = self._fail_unencodable(so) if so.new_requests else []
        if not so.num_scheduled_tokens and not so.finished_req_ids:
            return failed
        flight = self.flight
        if flight is not None:
            flight.begin(so)
        try:
            out = self.executor.execute_model(so)
        except BaseException as e:
            if flight is not None:
                flight.fail(so, f"{type(e).__name__}: {e}")
            raise
        if flight is not None or self.recorder is not None:
            step = RecordedStep.of(so, out)
            if flight is not None:
                flight.end(step)
            if self.recorder is not None:
                self.recorder.record(step)
        results = failed + self.scheduler.update_from_output(so, out)
        self.last_step_ms = (time.perf_counter() - t0) * 1000
        return results

    def _fail_unencodable(self, so: SchedulerOutput) -> list[tuple]:
        """New requests are the only part of a step message that carries what a caller sent: one that the
        wire format cannot carry (an integer past 64 bits, text that is not Unicode) fails alone here,
        instead of failing the encoding of the whole step in the executor."""
        failed = []
        for r in list(so.new_requests):
            try:
                _encoder.encode(r)
            except Exception as e:
                req = self.scheduler.fail_request(r.req_id, f"request {r.req_id!r} cannot be sent to the workers: "
                                                            f"{type(e).__name__}: {e}")
                so.new_requests.remove(r)
                del so.num_scheduled_tokens[r.req_id]
                if req is not None:
                    failed.append((req, None, None))
        return failed

    def stats(self) -> dict:
        return {**self.scheduler.stats(), "last_step_ms": self.last_step_ms}

    def shutdown(self, force: bool = False) -> None:
        try:
            self.executor.shutdown(force)
        finally:
            remove_run_files(self.config.run_id)
            if self.recorder is not None:
                self.recorder.close()
