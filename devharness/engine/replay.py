"""`devharness replay DIR`: a recording's step messages run straight on an executor (no scheduler:
the very batches, block tables and seeds of the recorded run), each step's sampled tokens compared
with the recording. On its own layout or another (record on uni, replay on tp=2 x pp=2).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import msgspec

from devharness.config import DebugConfig
from devharness.engine.record import RecordedStep, model_identity, read_recording
from devharness.messages import ModelRunnerOutput


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

    @property
    def ok(self) -> bool:
        return self.difference is None

    def verdict(self) -> str:
        if self.difference is None:
            return f"replay: {self.num_steps} steps, all tokens match ({self.layout})"
        return f"replay: {self.difference.describe()} ({self.layout}, after {self.num_steps - 1} matching steps)"


def compare(step: RecordedStep, out: ModelRunnerOutput) -> Difference | None:
    recorded = dict(zip(step.req_ids, step.sampled_token_ids))
    replayed = dict(zip(out.req_ids, out.sampled_token_ids))
    for rid in dict.fromkeys([*step.req_ids, *out.req_ids]):
        if recorded.get(rid) != replayed.get(rid):
            return Difference(step.scheduler_output.step, rid, replayed.get(rid), recorded.get(rid))
    return None


def replay(directory, tensor_parallel_size: int | None = None, pipeline_parallel_size: int | None = None,
           distributed_executor_backend: str | None = None, model: str | None = None,
           threads_per_worker: int | None = None, inject: str | None = None, debug: bool | DebugConfig = False,
           break_at_step: int | None = None, break_rank: int | None = None,
           debug_api_port: int | None = None) -> ReplayResult:
    """`debug`, `break_at_step`, `break_rank`, `debug_api_port`: engine/replay_debug.py (stop rank
    `break_rank` at the recorded step `break_at_step` for a debugger; serve the debug API on that port)."""
    from devharness.engine import replay_debug
    from devharness.engine.core import EngineCore
    from devharness.model.loader import resolve_model

    rec = read_recording(directory)
    cfg = rec.config
    p = cfg.parallel
    tp, pp = tensor_parallel_size or p.tensor_parallel_size, pipeline_parallel_size or p.pipeline_parallel_size
    same_layout = (tp, pp) == (p.tensor_parallel_size, p.pipeline_parallel_size)
    backend = distributed_executor_backend or (p.distributed_executor_backend if same_layout else None)
    parallel = msgspec.structs.replace(p, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                       distributed_executor_backend=backend,
                                       threads_per_worker=threads_per_worker or p.threads_per_worker)
    debug, brk = replay_debug.plan(debug, break_at_step, break_rank,
                                   [s.scheduler_output.step for s in rec.steps], parallel.world_size, debug_api_port)
    # The block ids in the step messages refer to the recorded cache: the replay's has the same size.
    scheduler = msgspec.structs.replace(cfg.scheduler, num_kv_blocks=rec.manifest["num_kv_blocks"])
    config = msgspec.structs.replace(cfg, run_id=uuid.uuid4().hex[:12], parallel=parallel, scheduler=scheduler,
                                     debug=debug, record_dir=None, inject=inject)
    name = model or cfg.model.model
    source = resolve_model(name)
    recorded_model = rec.manifest.get("model", {})
    if model_identity(source)["arch"] != recorded_model.get("arch"):
        raise ValueError(f"{directory}: recorded with model {recorded_model.get('name')!r}, whose architecture "
                         f"differs from {name!r}'s: a recording replays only on the model it was made with")
    config = msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, model=name))
    if inject:
        from devharness.debug import faults
        faults.check_fits(faults.parse(inject), parallel.world_size, source.arch.num_hidden_layers, tp)
    core = EngineCore(config, source, rec.manifest["max_model_len"])
    layout = f"tp={tp} pp={pp} {core.executor.config.parallel.distributed_executor_backend or ''}".strip()
    debug_session = replay_debug.Session(brk, debug_api_port)
    try:
        debug_session.start(core)
        for i, step in enumerate(rec.steps, 1):
            diff = compare(step, core.executor.execute_model(step.scheduler_output))
            if diff is not None:
                return ReplayResult(i, len(rec.steps), layout, diff)
    finally:
        debug_session.close()
        core.shutdown()
    return ReplayResult(len(rec.steps), len(rec.steps), layout)


def replay_main(args) -> int:
    from devharness.engine import replay_debug
    result = replay(args.directory, args.tp, args.pp, args.executor, args.model, args.threads_per_worker, args.inject,
                    **replay_debug.from_cli_args(args))
    if args.json:
        d = result.difference
        print(json.dumps({"ok": result.ok, "num_steps": result.num_steps, "total_steps": result.total_steps,
                          "layout": result.layout, "difference": None if d is None else vars(d),
                          "verdict": result.verdict()}))
    else:
        print(result.verdict())
    return 0 if result.ok else 1
