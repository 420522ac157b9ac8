"""EngineCore: the scheduler, the KV block budget and the executor, stepped in one loop."""
from __future__ import annotations

import gc
import logging
import time
from collections import deque

import msgspec

from devharness.config import EngineConfig
from devharness.engine.record import FlightRecorder
from devharness.protocol.recording import RecordedStep
from devharness.engine.request import Request, RequestStatus
from devharness.engine.scheduler import Scheduler
from devharness.executor.base import Executor, StepFuture
from devharness.protocol.errors import NON_FINITE
from devharness.protocol.messages import (DriverStep, GetNumerics, GetWeightFormat, InitKvCache, KvCacheBlockBytes,
                                          ReadClock, RequestError, SchedulerOutput, WeightFormat)
from devharness.model.loader import ModelSource
from devharness.worker.worker import freeze_startup_heap

logger = logging.getLogger(__name__)
DRIVER_STEPS = 256   # the driver's steps kept for the timeline (devharness trace's driver process)
_encoder = msgspec.msgpack.Encoder()


class EngineCore:
    """Token-level engine: requests in, sampled tokens out, one `step()` at a time."""

    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int):
        self.config = config
        self.source = source
        self.max_model_len_requested = max_model_len
        self._shut_down = False
        t0 = time.monotonic()
        # Workers that start and then fail may leave their state files: the runner removes them.
        self.executor = Executor.get_class(config.parallel.distributed_executor_backend)(config, source, max_model_len)
        self.workers_start_s = time.monotonic() - t0   # how long a restart may take, roughly
        try:
            self.weights = WeightFormat.merged(self.executor.control(GetWeightFormat()))
            self.num_kv_blocks = self._size_kv_cache()
            self.executor.control(InitKvCache(self.num_kv_blocks))
            self.clock_offsets_ns, self.clock_uncertainty_ns = self._measure_clocks()
            # The driver's process, as each worker process does its own (Worker.init_kv_cache).
            logger.debug("the engine froze the %d objects made at start-up", freeze_startup_heap())
            self.step_recorder = None
            self.flight = FlightRecorder(config.flight_steps) if config.flight_steps else None
            if config.record_dir:
                from devharness.engine.record import StepRecorder
                self.step_recorder = StepRecorder(config.record_dir, config, source, self.num_kv_blocks,
                                                  min(max_model_len, self.num_kv_blocks * config.scheduler.block_size),
                                                  self.weights)
        except BaseException:   # the workers this started stop with it
            self.executor.shutdown()
            raise
        # A request that fills max_model_len must fit in the cache alone, or it could never run.
        self.max_model_len = min(max_model_len, self.num_kv_blocks * config.scheduler.block_size)
        if self.max_model_len < max_model_len:
            logger.warning("KV cache holds %d blocks: max_model_len lowered from %d to %d",
                           self.num_kv_blocks, max_model_len, self.max_model_len)
        # Batches in flight (vLLM's batch queue): where the executor can, several steps of disjoint requests
        # run at once, so that each pipeline stage works on its own batch; they come back in order.
        self.max_concurrent_batches = config.parallel.batches_in_flight if self.executor.supports_async_steps else 1
        if self.max_concurrent_batches < config.parallel.batches_in_flight:
            logger.info("the %s executor runs one batch at a time (max_concurrent_batches=%d not used)",
                        config.parallel.distributed_executor_backend, config.parallel.batches_in_flight)
        self.batch_queue: deque[tuple[SchedulerOutput, StepFuture]] = deque()
        self.scheduler = Scheduler(config.scheduler, self.num_kv_blocks, self.max_concurrent_batches)
        self.last_step_ms = 0.0
        self.numerics_alarm: tuple | None = None   # the numerics check's last alarm, for the runner's bundle
        # The driver's side of the last steps (a small record each; applied filled in when the output is applied).
        self.driver_steps: deque[DriverStep] = deque(maxlen=DRIVER_STEPS)

    def _measure_clocks(self, tries: int = 5) -> tuple[dict[int, int], dict[int, int]]:
        """Each rank's wall clock less the driver's (ns), and half the round trip it was read over: of `tries`
        reads, the one with the shortest round trip (the rank's read falls inside it; its middle is the best
        guess, off by half the round trip at most)."""
        offsets, uncertainty = {}, {}
        for rank in range(self.executor.world_size):
            best = None
            for _ in range(tries):
                t0 = time.time_ns()
                theirs = self.executor.control(ReadClock(), ranks=[rank])[0]
                t1 = time.time_ns()
                if best is None or t1 - t0 < best[0]:
                    best = (t1 - t0, theirs - (t0 + t1) // 2)
            offsets[rank], uncertainty[rank] = best[1], best[0] // 2
        return offsets, uncertainty

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
        return self.scheduler.has_unfinished() or bool(self.batch_queue)

    @property
    def num_batches_in_flight(self) -> int:
        return len(self.batch_queue)

    def step(self, max_in_flight: int | None = None) -> list[tuple]:
        """Schedule a batch and send it to the workers; apply the sampled tokens of the oldest batch in flight
        once `max_in_flight` (default max_concurrent_batches) are, or nothing more can be scheduled. At 1: run
        one batch to its end. [(request, token, logprobs)]; a request that failed on its own comes back as
        (request, None, None) with its error set."""
        t0 = time.perf_counter()
        limit = min(max_in_flight or self.max_concurrent_batches, self.max_concurrent_batches)
        failed, submitted = [], False
        if len(self.batch_queue) < limit:
            scheduled = time.time()
            so = self.scheduler.schedule()
            failed = self._fail_unencodable(so) if so.new_requests else []
            if so.num_scheduled_tokens or so.finished_req_ids:
                self.driver_steps.append(DriverStep(so.step, scheduled, time.time(), tokens=so.num_scheduled_tokens))
                self._submit(so)
                submitted = True
        else:   # the waiting requests wait for a batch slot: their story says so
            self.scheduler.note_batch_queue_full(len(self.batch_queue))
        if not self.batch_queue or (submitted and len(self.batch_queue) < limit):
            return failed
        results = failed + self._collect()
        self.last_step_ms = (time.perf_counter() - t0) * 1000
        return results

    def _submit(self, so: SchedulerOutput) -> None:
        flight = self.flight
        if flight is not None:
            flight.begin(so)
        try:
            # One batch at a time: the step runs to its end in execute_model.
            future = (self.executor.execute_model_async(so) if self.max_concurrent_batches > 1
                      else StepFuture.done(so.step, self.executor.execute_model(so)))
        except BaseException as e:
            if flight is not None:
                flight.fail(so, f"{type(e).__name__}: {e}")
            raise
        self.batch_queue.append((so, future))

    def _collect(self) -> list[tuple]:
        """The oldest batch in flight: wait for its output, record it (steps complete in the order they were
        sent), apply it."""
        so, future = self.batch_queue.popleft()
        try:
            out = future.result()
            done = time.time()
        except BaseException as e:
            if self.flight is not None:
                self.flight.fail(so, f"{type(e).__name__}: {e}")
            raise
        if out.numerics is not None:
            self._numerics_alarm(so, out)
        if self.flight is not None or self.step_recorder is not None:
            step = RecordedStep.of(so, out)
            if self.flight is not None:
                self.flight.end(step)
            if self.step_recorder is not None:
                self.step_recorder.record(step)
        results = self.scheduler.update_from_output(so, out)
        rec = self._driver_step(so.step)
        if rec is not None:
            rec.done, rec.applied = done, time.time()
        return results

    def _driver_step(self, step: int) -> DriverStep | None:
        for rec in reversed(self.driver_steps):   # the oldest in flight is near the end
            if rec.step == step:
                return rec
        return None

    def _numerics_alarm(self, so: SchedulerOutput, out) -> None:
        """The output rank met a non-finite value in step `so`: every rank's record says where it was born
        (debug/numerics.py decides); the requests whose rows held it fail with that error, the others go on. What was
        found waits in `numerics_alarm` for the runner's bundle."""
        from devharness.debug import numerics
        try:
            reports = self.executor.control(GetNumerics())
        except Exception as e:   # a rank that cannot answer: the output rank's own alarm is what is known
            logger.warning("numerics: could not read every rank's record (%s: %s)", type(e).__name__, e)
            reports = []
        alarms = [a for r in reports for a in r.alarms] or [out.numerics]
        born, summary, errors = numerics.decide(so.step, alarms)
        logger.error("%s", summary)
        failed = {f.req_id for f in out.failed}
        out.failed = list(out.failed) + [RequestError(rid, msg, NON_FINITE) for rid, msg in errors.items()
                                         if rid not in failed]
        self.numerics_alarm = ((born.rank, born.layer, born.site), summary, reports)

    def take_numerics_alarm(self):
        """((rank, layer, site) it was born at, what was born where, every rank's NumericsReport) of the last alarm not
        taken yet; None if none."""
        alarm, self.numerics_alarm = self.numerics_alarm, None
        return alarm

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
                self.scheduler.in_flight.discard(r.req_id)   # never sent: no step will bring it back
                if req is not None:
                    failed.append((req, None, None))
        return failed

    def restart_workers(self, reason: str) -> list[Request]:
        """After a worker died (or a failed step left the workers unusable): end every request with `reason`,
        freeing its KV blocks, then stop the workers and start a fresh set from the same config, with the same
        KV cache size. Returns the requests it ended. Raises what starting the new workers raised."""
        failed = self.scheduler.fail_all(reason)
        self.batch_queue.clear()
        # What the old workers leave in this process (all of the in-process worker, still held by the failure being
        # handled) was frozen with the rest at start-up: give it back to the collector, for good.
        gc.unfreeze()
        t0 = time.monotonic()
        self.executor.restart_workers()
        if self._shut_down:   # shutdown() came from another thread while the new workers started
            self.executor.shutdown()
            raise RuntimeError("the engine was shut down while its workers restarted")
        self.executor.control(InitKvCache(self.num_kv_blocks))
        self.workers_start_s = time.monotonic() - t0
        logger.warning("workers restarted in %.1f s (%d requests ended: %s)", self.workers_start_s, len(failed), reason)
        return failed

    def stats(self) -> dict:
        return {**self.scheduler.stats(), "last_step_ms": self.last_step_ms,
                "batches_in_flight": len(self.batch_queue)}

    def shutdown(self, force: bool = False) -> None:
        self._shut_down = True
        try:
            self.executor.shutdown(force)
        finally:
            if self.step_recorder is not None:
                self.step_recorder.close()
            gc.unfreeze()   # what start-up froze, this engine's objects among it, is the collector's again
