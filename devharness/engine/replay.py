"""`devharness replay DIR|BUNDLE`: a recording's step messages run straight on an executor (no scheduler:
the very batches, block tables and seeds of the recorded run), each step's sampled tokens compared
with the recording. On its own layout or another (record on uni, replay on tp=2 x pp=2).

A bundle's steps start mid-run, on an empty KV cache: a request the workers held from before the
window is sent whole at its first step there, with everything before that step computed again
(as after a preemption), and so is a prefix-cache hit on blocks filled before the window. A step
that failed or hung in the recorded run is run last: replay says whether it fails again. The
recording's planted bug (`--inject`) is planted again unless `--inject none`.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import msgspec

from devharness.config import DebugConfig
from devharness.debug.state import remove_run_files
from devharness.engine.record import model_identity
from devharness.protocol.recording import FAILED, Recording, RecordedStep, read_recording
from devharness.protocol.messages import ModelRunnerOutput, NewRequest, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class Difference:
    step: int
    request_id: str
    replayed: int | None      # None: the replay sampled nothing for it (or failed it)
    recorded: int | None

    def describe(self) -> str:
        def tok(t):
            return "nothing" if t is None else str(t)
        return f"step {self.step} differs: request {self.request_id} token {tok(self.replayed)} vs {tok(self.recorded)}"


@dataclass
class ReplayResult:
    num_steps: int                      # steps run (up to and including a differing one)
    total_steps: int
    layout: str
    difference: Difference | None = None
    last_step: int | None = None        # the step number of the last one run
    recorded_error: str | None = None   # the last step did not finish when recorded: what happened
    recorded_error_kind: str | None = None   # and how: FAILED (a worker raised) or UNFINISHED (it hung)
    error: str | None = None            # what the replay raised, at step last_step
    max_digest_diff: float | None = None   # largest |difference| of the sampled rows' (max logit, logsumexp)
    kernels: str = ""                   # the kernel backend the replay ran
    recorded_kernels: str | None = None   # the recording's (None: it does not say: made before recordings did)
    weights: str = ""                   # how the replay's workers hold the weights (WeightFormat.summary)
    recorded_weights: str | None = None   # the recording's (None: it does not say: made before recordings did)

    @property
    def ok(self) -> bool:
        if self.difference is not None:
            return False
        if self.error is not None:      # a failure the recording does not have is a difference
            return self.recorded_error_kind is not None
        return self.recorded_error_kind != FAILED

    @property
    def other_kernels(self) -> bool:
        """The replay ran other kernels than the recording's (so its logits may differ in the last bits)."""
        return self.recorded_kernels is not None and self.kernels != self.recorded_kernels

    @property
    def other_weights(self) -> bool:
        """The replay holds the weights otherwise than the recording did (dequantized against as shipped, other
        quantized types): its logits may differ, its tokens too."""
        return self.recorded_weights is not None and self.weights != self.recorded_weights

    def verdict(self) -> str:
        """One line."""
        error = (self.error or "").splitlines()[0] if self.error else None
        recorded = self.recorded_error.splitlines()[0] if self.recorded_error else None
        where = self.layout + (f", kernels {self.kernels}, recorded with {self.recorded_kernels}" if self.other_kernels
                               else f", kernels {self.kernels}" if self.kernels else "")
        if self.other_weights:
            where += f", weights {self.weights}, recorded with {self.recorded_weights}"
        if self.difference is not None:
            return f"replay: {self.difference.describe()} ({where}, after {self.num_steps - 1} matching steps)"
        before = f"{self.num_steps - 1} matching steps before it"
        if self.error is not None and self.recorded_error_kind is None:
            return f"replay: step {self.last_step} failed here but not in the recording: {error} ({where}, {before})"
        if self.error is not None:
            return (f"replay: {self.num_steps} steps, tokens match up to step {self.last_step}, which fails again as "
                    f"recorded: {error} ({where})")
        if self.recorded_error_kind == FAILED:
            return (f"replay: step {self.last_step} failed in the recording ({recorded}) but ran "
                    f"here ({where}, {before})")
        if self.recorded_error_kind is not None:
            return (f"replay: {self.num_steps} steps, all tokens match; step {self.last_step}, unfinished in the "
                    f"recording, ran to its end here ({where})")
        digests = "" if self.max_digest_diff is None else ", logits digests bit-equal" if self.max_digest_diff == 0 \
            else f", logits digests within {self.max_digest_diff:.1e}"
        return f"replay: {self.num_steps} steps, all tokens match ({where}){digests}"


def compare(step: RecordedStep, out: ModelRunnerOutput) -> Difference | None:
    recorded = dict(zip(step.req_ids, step.sampled_token_ids))
    replayed = dict(zip(out.req_ids, out.sampled_token_ids))
    for rid in dict.fromkeys([*step.req_ids, *out.req_ids]):
        if recorded.get(rid) != replayed.get(rid):
            return Difference(step.scheduler_output.step, rid, replayed.get(rid), recorded.get(rid))
    return None


def digest_diff(step: RecordedStep, out: ModelRunnerOutput) -> float | None:
    if step.logits_digest is None or out.logits_digest is None:
        return None
    replayed = dict(zip(out.req_ids, out.logits_digest))
    diffs = [max(abs(a - b) for a, b in zip(d, replayed[rid]))
             for rid, d in zip(step.req_ids, step.logits_digest) if rid in replayed]
    return max(diffs, default=None)


def step_messages(rec: Recording):
    """The recording's step messages as the replay's workers must receive them. A full recording's are
    sent as recorded; a partial one's (a bundle) start on an empty cache, see the module's docstring."""
    if not rec.partial:
        for step in rec.steps:
            yield step.scheduler_output
        return
    held: dict[str, NewRequest] = {r.req_id: r for r in rec.held}
    known: set[str] = set()
    for step in rec.steps:
        so = step.scheduler_output
        scheduled = dict(so.num_scheduled_tokens)     # same order: requests run in this order
        new, cached = [], []
        for rid in so.finished_req_ids:
            known.discard(rid)
            held.pop(rid, None)
        for r in so.new_requests:
            known.add(r.req_id)
            held.pop(r.req_id, None)
            if r.num_computed_tokens and r.req_id in scheduled:   # prefix hit: those blocks may predate the window
                scheduled[r.req_id] += r.num_computed_tokens
                r = msgspec.structs.replace(r, num_computed_tokens=0)
            new.append(r)
        for c in so.cached_requests:
            h = held.pop(c.req_id, None)
            if c.req_id in known or h is None:
                cached.append(c)
                continue
            known.add(c.req_id)
            new.append(NewRequest(c.req_id, h.token_ids + c.new_token_ids, h.num_prompt_tokens,
                                  h.block_ids + c.new_block_ids, 0, h.sampling, h.sampling_seed))
            if c.req_id in scheduled:
                scheduled[c.req_id] += c.num_computed_tokens
        yield SchedulerOutput(so.step, new, cached, scheduled, so.finished_req_ids)


def replay(directory, tensor_parallel_size: int | None = None, pipeline_parallel_size: int | None = None,
           distributed_executor_backend: str | None = None, model: str | None = None,
           threads_per_worker: int | None = None, inject: str | None = None, debug: bool | DebugConfig = False,
           break_at_step: int | None = None, break_rank: int | None = None,
           debug_api_port: int | None = None, kernels: str | None = None, debug_api=None) -> ReplayResult:
    """`debug`, `break_at_step`, `break_rank`, `debug_api_port`, `debug_api`: engine/replay_debug.py (stop rank
    `break_rank` at the recorded step `break_at_step` for a debugger; serve the debug API on that port with
    `debug_api`, server/replay_api.py's ReplayDebugServer).
    `kernels`: the kernel backend to run (default: the recording's, so that its logits come out bit for bit)."""
    from devharness.engine import replay_debug
    from devharness.engine.core import EngineCore
    from devharness.engine.llm_engine import with_kernels_resolved, with_layer_partition
    from devharness.kernels import check_backend
    from devharness.debug import faults
    from devharness.model.loader import resolve_model

    if inject not in (None, "none") and faults.parse(inject).kind in faults.DRIVER_KINDS:
        raise ValueError(f"--inject {inject!r}: a KV fault is planted on the scheduler's block manager, and a replay "
                         f"runs the recorded steps without a scheduler")
    rec = read_recording(directory)
    cfg = rec.config
    p = cfg.parallel
    tp, pp = tensor_parallel_size or p.tensor_parallel_size, pipeline_parallel_size or p.pipeline_parallel_size
    same_layout = (tp, pp) == (p.tensor_parallel_size, p.pipeline_parallel_size)
    backend = distributed_executor_backend or (p.distributed_executor_backend if same_layout else None)
    parallel = msgspec.structs.replace(p, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                       distributed_executor_backend=backend,
                                       threads_per_worker=threads_per_worker or p.threads_per_worker,
                                       pp_layer_partition=p.pp_layer_partition if pp == p.pipeline_parallel_size
                                       else None)
    debug, brk = replay_debug.plan(debug, break_at_step, break_rank,
                                   [s.scheduler_output.step for s in rec.steps], parallel.world_size, debug_api_port,
                                   debug_api)
    # The block ids in the step messages refer to the recorded cache: the replay's has the same size.
    scheduler = msgspec.structs.replace(cfg.scheduler, num_kv_blocks=rec.manifest.num_kv_blocks)
    # A recording of a planted bug plants it again, unless told otherwise ("none"); a KV fault's effect is in the
    # recorded block tables already.
    recorded = cfg.inject if cfg.inject and faults.parse(cfg.inject).kind not in faults.DRIVER_KINDS else None
    inject = recorded if inject is None else (None if inject == "none" else inject)
    config = msgspec.structs.replace(cfg, run_id=uuid.uuid4().hex[:12], parallel=parallel, scheduler=scheduler,
                                     debug=debug, record_dir=None, inject=inject, flight_steps=0,
                                     digest_logits=True, otlp_traces_endpoint=None)   # sends nowhere it was told
    name = model or cfg.model.model
    source = resolve_model(name)
    recorded_model = rec.manifest.model
    if model_identity(source)["arch"] != recorded_model.get("arch"):
        raise ValueError(f"{directory}: recorded with model {recorded_model.get('name')!r}, whose architecture "
                         f"differs from {name!r}'s: a recording replays only on the model it was made with")
    recorded_kernels = (rec.manifest.kernels or {}).get("backend")
    config = msgspec.structs.replace(config, model=msgspec.structs.replace(
        config.model, model=name, kernels=check_backend(kernels or recorded_kernels or config.model.kernels)))
    config = with_kernels_resolved(with_layer_partition(config, source.arch))   # another pp: its balanced partition
    parallel = config.parallel
    if inject:
        faults.check_fits(faults.parse(inject), parallel.world_size, source.arch.num_hidden_layers, tp,
                          parallel.pp_layer_partition)
    try:   # the replay's own workers: their run files are its to remove (an engine's are its runner's)
        core = EngineCore(config, source, rec.manifest.max_model_len)
    except BaseException:
        remove_run_files(config.run_id)
        raise
    layout = f"tp={tp} pp={pp} {core.executor.config.parallel.distributed_executor_backend or ''}".strip()
    recorded_weights = rec.manifest.weights
    result = ReplayResult(0, len(rec.steps), layout, kernels=config.model.kernels, recorded_kernels=recorded_kernels,
                          weights=core.weights.summary(),
                          recorded_weights=None if recorded_weights is None else recorded_weights.summary())
    if result.other_weights:
        logger.warning("replay: the weights are held otherwise than when recorded: %s here, %s in the recording "
                       "(logits may differ, tokens too)", result.weights, result.recorded_weights)
    debug_session = replay_debug.Session(brk, debug_api_port, debug_api=debug_api)
    try:
        debug_session.start(core)
        for step, so in zip(rec.steps, step_messages(rec)):
            result.num_steps += 1
            result.last_step, result.recorded_error, result.recorded_error_kind = so.step, step.error, step.error_kind
            try:
                out = core.executor.execute_model(so)
            except Exception as e:
                result.error = f"{type(e).__name__}: {e}"
                break
            if step.error_kind is not None:
                break   # nothing was sampled in the recording to compare with
            d = digest_diff(step, out)
            if d is not None:
                result.max_digest_diff = max(d, result.max_digest_diff or 0.0)
            result.difference = compare(step, out)
            if result.difference is not None:
                break
    finally:
        debug_session.close()
        try:
            core.shutdown(force=result.error is not None)
        finally:
            remove_run_files(config.run_id)
    return result
