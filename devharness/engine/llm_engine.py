"""LLMEngine: the engine a runner steps (engine/runner.py): prompts in, RequestOutputs out. It starts the model's
engine core (engine/core.py: the scheduler and the workers) and joins it to the input processor
(engine/input_processor.py: prompts checked and made into requests, so a bad request never disturbs the others) and
the output processor (engine/output.py: sampled tokens detokenized into outputs); callers ask it, never the core."""
from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass

import msgspec

from devharness.config import EngineConfig
from devharness.debug import profiler
from devharness.engine.core import EngineCore
from devharness.engine.input_processor import InputProcessor
from devharness.engine.output import OutputProcessor, RequestOutput
from devharness.engine.record import FlightRecorder, make_manifest
from devharness.engine.request import RequestStatus
from devharness.engine.scheduler import SchedulerSnapshot
from devharness.executor.base import Executor
from devharness.model.decoder import balanced_layer_partition, stage_layer_range
from devharness.model.loader import load_tokenizer, resolve_model
from devharness.protocol.messages import (KvSnapshot, ProfileResult, RequestsSnapshot, RequestStory, StartProfile,
                                          StopProfile)
from devharness.protocol.recording import Manifest
from devharness.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def with_layer_partition(config: EngineConfig, arch) -> EngineConfig:
    """The config with its pipeline stages' layers written out: with pp > 1 and no pp_layer_partition, the
    partition that evens out the stages' work, the LM head counted (model/decoder.py), so that every rank,
    the fault checks, bundles and recordings name the same layers per stage."""
    p = config.parallel
    if p.pipeline_parallel_size == 1 or p.pp_layer_partition is not None:
        return config
    partition = balanced_layer_partition(arch, p.pipeline_parallel_size)
    logger.info("pp_layer_partition %s: the layers per stage that even out the stages' work, the last stage's LM "
                "head counted", ",".join(map(str, partition)))
    return msgspec.structs.replace(config, parallel=msgspec.structs.replace(p, pp_layer_partition=partition))


def with_kernels_resolved(config: EngineConfig) -> EngineConfig:
    """The config with the kernel backend its workers will run: "fast" on a CPU whose C kernels cannot be built here
    becomes "reference" (warned once, by the build), so that every rank, recordings and bundles name the kernels
    that ran."""
    from devharness.kernels import kernels_for
    m = config.model
    ran = kernels_for(m.kernels, "cuda" if m.device.startswith("cuda") else "cpu").backend
    return config if ran == m.kernels else msgspec.structs.replace(config, model=msgspec.structs.replace(m, kernels=ran))


@dataclass(frozen=True)
class EngineView:
    """What the /debug routes read of the engine, taken on its runner's thread between steps (LLMEngine.debug_view):
    the KV cache map, every request's story in brief and the stalls, and each of those stories with its events."""
    step: int
    paused: bool
    kv: KvSnapshot
    requests: RequestsSnapshot
    stories: dict[str, RequestStory]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if not config.run_id:   # minted once, by the runner that starts the engine and owns its files
            raise ValueError("LLMEngine needs config.run_id: start it with EngineRunner.start, which makes one")
        self.config = config
        if config.debug.enabled and not config.debug.host_is_loopback:
            logger.warning("debug listeners will bind %s: anyone who reaches ports %d.. can run any code "
                           "in the workers", config.debug.host, config.debug.port_base)
        self.source = resolve_model(config.model.model)
        arch = self.source.arch
        max_len = config.model.max_model_len or arch.max_position_embeddings
        if max_len > arch.max_position_embeddings and arch.rope_scaling is None:
            raise ValueError(f"ModelConfig.max_model_len={max_len} exceeds the model's "
                             f"max_position_embeddings {arch.max_position_embeddings}")
        if arch.sliding_window is not None and arch.sliding_window < max_len:
            # Up to the window, sliding-window attention is plain causal attention; beyond it we would be wrong.
            raise ValueError(f"{self.source.name}: sliding_window={arch.sliding_window} is shorter than "
                             f"max_model_len={max_len} and sliding-window attention is not implemented; "
                             f"pass max_model_len={arch.sliding_window} or less")
        self._check_parallel_fits()
        self.config = config = with_kernels_resolved(with_layer_partition(config, arch))
        if config.inject:
            from devharness.debug import faults
            p = config.parallel
            faults.check_fits(faults.parse(config.inject), p.world_size, arch.num_hidden_layers, p.tensor_parallel_size,
                              p.pp_layer_partition)
        self.tokenizer = load_tokenizer(self.source)
        self.eos_token_ids = arch.eos_token_ids or (self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.tracer = None   # --otlp-traces-endpoint: each ended request's story goes out as spans
        if config.otlp_traces_endpoint:
            from devharness.engine.tracing import RequestTracer
            self.tracer = RequestTracer(config.otlp_traces_endpoint, config.model.model)
        try:
            self.core = EngineCore(config, self.source, max_len)
        except BaseException:
            if self.tracer is not None:
                self.tracer.shutdown()
            raise
        if self.tracer is not None:
            self.core.scheduler.stories.on_end = self.tracer.export
        if config.inject:   # a KV or scheduler fault is the driver's (debug/kv_faults.py, debug/sched_faults.py)
            from devharness.debug import faults, kv_faults, sched_faults
            spec = faults.parse(config.inject)
            kv_faults.install(spec, self.core.scheduler) or sched_faults.install(spec, self.core.scheduler)
        self.input_processor = InputProcessor(self.source, self.tokenizer, max_len, self.eos_token_ids,
                                              config.model.seed)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.profile_kind: str | None = None   # the profile start_profile began, until stop_profile

    def _check_parallel_fits(self) -> None:
        a, p = self.source.arch, self.config.parallel
        tp, pp = p.tensor_parallel_size, p.pipeline_parallel_size
        heads, kv = a.num_attention_heads, a.num_key_value_heads
        ok_tp = [t for t in range(1, heads + 1) if heads % t == 0 and (kv % t == 0 or t % kv == 0)]
        if tp not in ok_tp:
            raise ValueError(f"tensor_parallel_size={tp} does not fit {self.source.name}: its {heads} attention "
                             f"heads and {kv} KV heads must split evenly; sizes that work: {ok_tp}")
        if a.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the MLP size {a.intermediate_size} of "
                             f"{self.source.name}; sizes that work: {[t for t in ok_tp if a.intermediate_size % t == 0]}")
        if pp > a.num_hidden_layers:
            raise ValueError(f"pipeline_parallel_size={pp} exceeds the {a.num_hidden_layers} layers of "
                             f"{self.source.name}; use at most {a.num_hidden_layers}")
        stage_layer_range(a.num_hidden_layers, pp, 0, p.pp_layer_partition)   # a partition must sum to the layers

    def take_numerics_alarm(self):
        """The numerics check's last alarm not taken yet (EngineCore.take_numerics_alarm); None if none."""
        return self.core.take_numerics_alarm()

    def kv_snapshot(self):
        """The KV cache as the block manager holds it (protocol/messages.py KvSnapshot): every block's reference
        count, hash and generation, each request's table, the last events. Engine thread (or while it waits on a
        step)."""
        return self.core.scheduler.kv_snapshot()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (BlockManager.reset_prefix_cache); False, changing nothing, while a request
        holds KV blocks."""
        if self.core.num_batches_in_flight:
            return False
        return self.core.scheduler.block_manager.reset_prefix_cache()

    def requests_snapshot(self, paused: bool = False):
        """Every running and waiting request's story in brief, the last finished ones', and the stalls seen
        (protocol/messages.py RequestsSnapshot; engine/request_story.py). `paused`: the engine is paused, the
        reason every waiting request waits now. Engine thread (or between steps)."""
        sched = self.core.scheduler
        return sched.stories.snapshot(sched.step_count, paused)

    def request_story(self, request_id: str, paused: bool = False):
        """One request's story with its events (protocol/messages.py RequestStory); None for an id neither running,
        waiting nor among the last finished."""
        return self.core.scheduler.stories.story(request_id, paused)

    def clock_scheduler(self):
        """Time the scheduler's side of every step from now on (engine/sched_clock.py's SchedulerClock), for a
        bench; once per engine."""
        from devharness.engine.sched_clock import SchedulerClock
        return SchedulerClock(self.core.scheduler)

    def take_stalls(self) -> list:
        """The stalls the detector reported since the last call, each handed out once (the runner bundles them)."""
        return self.core.scheduler.stories.take_stalls()

    @property
    def clock_offsets_ns(self) -> dict[int, int]:
        """Each rank's wall clock less the driver's, measured at start-up (engine/core.py)."""
        return self.core.clock_offsets_ns

    def driver_timeline(self, steps: int | None = None):
        """The driver's last `steps` steps (all it keeps with None) and the stories, events included, of the requests
        it holds (protocol/messages.py DriverTimeline): devharness trace's driver process. Engine thread (or between
        steps)."""
        from devharness.protocol.messages import DriverTimeline
        recs = list(self.core.driver_steps)
        stories = self.core.scheduler.stories
        ids = [r.request_id for r in stories.snapshot(0, False).requests]
        return DriverTimeline(recs[-steps:] if steps else recs,
                              [st for st in (stories.story(i, False) for i in ids) if st is not None],
                              self.core.clock_offsets_ns, self.core.clock_uncertainty_ns)

    def debug_view(self, paused: bool = False) -> EngineView:
        """The KV map, the requests and their stories, as one step's end holds them (EngineView). Engine thread."""
        sched = self.core.scheduler
        stories = sched.stories
        requests = stories.snapshot(sched.step_count, paused)
        told = {r.request_id: stories.story(r.request_id, paused) for r in requests.requests}
        return EngineView(sched.step_count, paused, sched.kv_snapshot(), requests, told)

    @property
    def step_count(self) -> int:
        """The steps scheduled so far (one int: a bundle written while a step runs reads it from its own thread)."""
        return self.core.scheduler.step_count

    @property
    def num_batches_in_flight(self) -> int:
        return self.core.num_batches_in_flight

    @property
    def workers_start_s(self) -> float:
        """How long the workers took to start last time: how long a restart may take, roughly."""
        return self.core.workers_start_s

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def scheduler_snapshot(self) -> SchedulerSnapshot:
        """The scheduler as it stands, copied: the steps scheduled so far, and each running and waiting request's
        tokens and how many of them the KV cache holds (engine/scheduler.py). Engine thread (or between steps)."""
        return self.core.scheduler.snapshot()

    @property
    def flight_recorder(self) -> FlightRecorder | None:
        """The flight recorder (engine/record.py: the last `flight_steps` steps, kept for a bundle); None when
        `flight_steps` is 0. Its `window()` may be read from any thread."""
        return self.core.flight

    def manifest(self, partial: bool = False) -> Manifest:
        """What a recording of this engine's steps is made with (config, model, kernels, versions, KV cache): a
        bundle writes it beside the flight recorder's window, and its summary quotes the kernels and versions."""
        return make_manifest(self.config, self.source, self.core.num_kv_blocks, self.core.max_model_len,
                             partial=partial, weights=self.core.weights)

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None) -> str:
        text, ids = self.input_processor.process_prompt(prompt)
        return self.add_processed(text, ids, params, request_id)

    def add_processed(self, text: str | None, ids: list[int], params: SamplingParams,
                      request_id: str | None = None) -> str:
        """Add a request whose prompt the input processor made (text, token ids); its id."""
        inputs = self.input_processor
        inputs.check_params(params)
        rid = request_id or inputs.next_id()
        if rid in self.output_processor:   # before its seed is drawn: a refused request changes no other's seed
            raise ValueError(f"request id {rid!r} is already in use")
        req = inputs.make_request(ids, params, rid)
        self.output_processor.add(req, text)
        self.core.add_request(req)
        return req.req_id

    def abort_request(self, request_id: str) -> None:
        self.core.abort_request(request_id)
        self.output_processor.abort(request_id)

    def unfinished_request_ids(self) -> list[str]:
        """The ids of the requests added and not yet finished or aborted, in the order they were added."""
        return self.output_processor.request_ids()

    def abort_all_requests(self) -> list[str]:
        """Abort every unfinished request (abort_request each, freeing its KV blocks); the ids it aborted."""
        ids = self.unfinished_request_ids()
        for rid in ids:
            self.abort_request(rid)
        return ids

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    # -- stepping ---------------------------------------------------------------------------

    def step(self, max_in_flight: int | None = None) -> list[RequestOutput]:
        """One engine step (EngineCore.step): the outputs of the batch that came back, if one did. A step that raises
        leaves the workers unusable; what follows (a bundle, a restart, death) is its runner's to decide
        (engine/runner.py, the one caller)."""
        results = self.core.step(max_in_flight)
        return self.output_processor.process(
            results, lambda rid: self.core.finish_request(rid, RequestStatus.FINISHED_STOPPED))

    def stats(self) -> dict:
        return self.core.stats()

    def take_kv_alarms(self) -> list[str]:
        """The KV checksum mismatches the steps since the last call found (their requests have ended with them)."""
        sched = self.core.scheduler
        alarms, sched.kv_alarms = sched.kv_alarms, []
        return alarms

    @property
    def workers(self) -> Executor:
        """The workers as driver-side tools reach them: typed control calls (`control`), their pids and
        nodes. The one door for the monitor, check and the benches."""
        return self.core.executor

    def start_profile(self, kind: str = "torch", trace_dir: str | None = None, stand_ins: bool = False) -> None:
        """Run a profiler around every rank's steps until stop_profile (the kinds: debug/profiler.py). "torch"
        writes one Chrome trace per rank into `trace_dir` (made if missing; default: the config's profiler_dir,
        else <tempdir>/devharness-profiles) at stop_profile. Call it between steps (the engine's thread).
        ValueError: an unknown kind, an argument the kind does not take, a profile running already; WorkerError: a
        rank could not start it (none keeps a profile then)."""
        if self.profile_kind is not None:
            raise ValueError(f"a {self.profile_kind!r} profile is running: stop it first")
        if kind == "torch" and trace_dir is None:
            trace_dir = self.config.profiler_dir or os.path.join(tempfile.gettempdir(), "devharness-profiles")
        profiler.check(kind, trace_dir, stand_ins)
        if trace_dir is not None:   # the same folder for workers whose working directory differs (Ray actors)
            trace_dir = os.path.abspath(trace_dir)
        executor = self.core.executor
        started = []
        try:
            for rank in range(executor.world_size):   # rank by rank: the ones that started it stop it on a failure
                executor.control(StartProfile(kind, trace_dir, stand_ins), ranks=[rank])
                started.append(rank)
        except Exception:
            if started:
                executor.control(StopProfile(), ranks=started)
            raise
        self.profile_kind = kind

    def stop_profile(self) -> list[ProfileResult]:
        """End the profile start_profile began: what each rank measured, in rank order (a "torch" profile: the
        trace it wrote). ValueError: none runs."""
        if self.profile_kind is None:
            raise ValueError("no profile is running: start_profile first")
        self.profile_kind = None
        return self.core.executor.control(StopProfile())

    def check_health(self) -> None:
        """Raise if a worker is dead, without waiting on the workers (process sentinels, Ray liveness; the in-process
        worker answers a ping): cheap enough for the engine thread to call every second while idle."""
        self.core.executor.check_health()

    def restart_workers(self, reason: str) -> None:
        """End every request (they fail with `reason`) and start a fresh set of workers (EngineCore.restart_workers);
        the engine then takes requests again. Only on its runner's word (engine/runner.py)."""
        self.core.restart_workers(reason)
        self.output_processor.clear()
        self.profile_kind = None   # the new workers run none

    def shutdown(self, force: bool = False) -> None:
        """`force`: a step may still be running on another thread (a rank paused or hung): stop the
        workers without waiting for it. The spans not yet sent (--otlp-traces-endpoint) are sent."""
        try:
            self.core.shutdown(force)
        finally:
            if self.tracer is not None:
                self.tracer.shutdown()
