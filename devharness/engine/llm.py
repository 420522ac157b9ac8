"""LLM: the offline Python API, with vLLM's names."""
from __future__ import annotations

import logging
from collections.abc import Sequence

from devharness.engine.args import EngineArgs
from devharness.engine.output import RequestOutput
from devharness.engine.supervisor import EngineSupervisor
from devharness.protocol.messages import ProfileResult
from devharness.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    """Load a model on a tp x pp grid of workers and generate; `with LLM(...) as llm:` shuts it down."""

    def __init__(self, model: str | None = None, **kwargs):
        """`model`: as EngineArgs' (default: its default); `kwargs`: EngineArgs' other fields (tensor_parallel_size,
        distributed_executor_backend, seed, debug, ...)."""
        if model is not None:
            kwargs["model"] = model
        # The supervisor starts the engine and owns its life: whether a failed step restarts the workers or
        # leaves them failed is its to say, as in serve; it writes the bundles and runs the hang detector.
        self.supervisor = EngineSupervisor.start(EngineArgs.from_kwargs(**kwargs).create_engine_config())
        self.engine = self.supervisor.engine
        self.config = self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. All inputs are checked first.

        The engine steps here, on the caller's thread, not on an engine loop (engine/engine_loop.py, AsyncLLM's):
        no thread hop per call, nothing runs on the workers between calls (no liveness checks, no restart in the
        background), and a failed step raises its own error to the caller after the supervisor has done what it
        decided (a restart included)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        processed = [self.engine.process_prompt(p) for p in prompts]
        ids: list[str] = []
        finals: dict[str, RequestOutput] = {}
        pending: set[str] = set()
        try:
            for (text, tok), sp in zip(processed, params):   # one refused: none of them runs
                ids.append(self.engine.add_processed(text, tok, sp))
                pending.add(ids[-1])
            try:
                while pending:
                    for out in self.engine.step():
                        if out.finished:
                            finals[out.request_id] = out
                            pending.discard(out.request_id)
                    self.supervisor.machine.step_completed()
                # A batch may still be in flight (one that tells the workers to drop finished requests): it ends
                # here, so that nothing runs on the workers between calls.
                while self.engine.core.num_batches_in_flight:
                    self.engine.step()
                    self.supervisor.machine.step_completed()
            except Exception as e:
                # This call fails all the same; after a restart, the next one finds a fresh set of workers.
                if self._step_failed(f"{type(e).__name__}: {e}"):
                    pending.clear()   # the restart ended them
                raise
        except BaseException:
            for rid in pending:
                self.engine.abort_request(rid)
            raise
        return [finals[i] for i in ids]

    def _step_failed(self, cause: str) -> bool:
        """Report a failed step to the supervisor, which writes its bundle and restarts the workers if it decides
        to. True if they were restarted (every request ended); raises what starting the new workers raised."""
        outcome = self.supervisor.workers_failed(cause, step_error=cause)
        if not outcome.restart:
            if self.config.parallel.restart_workers:
                logger.error("%s", outcome.error)
            return False
        failed = self.supervisor.restart()
        if failed is not None:
            logger.error("%s", failed.error)
            raise self.supervisor.restart_error
        return True

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None):
        """Render each conversation with the model's chat template and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(c), add_special_tokens=False)}
                   for c in convs]
        return self.generate(prompts, sampling_params)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (vLLM's name), so that prompts seen before are computed again, as a
        benchmark that runs one workload several times needs. False, changing nothing, while a request runs."""
        return self.engine.reset_prefix_cache()

    def start_profile(self, kind: str = "torch", trace_dir: str | None = None, stand_ins: bool = False) -> None:
        """A profiler around every rank's steps until stop_profile (LLMEngine.start_profile): "torch" writes one
        Chrome trace per rank into `trace_dir`."""
        self.engine.start_profile(kind, trace_dir, stand_ins)

    def stop_profile(self) -> list[ProfileResult]:
        """What each rank's profiler measured, in rank order."""
        return self.engine.stop_profile()

    def stats(self) -> dict:
        return {**self.engine.stats(), **self.supervisor.live_stats()}

    def shutdown(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.supervisor.stop("the LLM was shut down")
            self.supervisor.shutdown()
            self.engine = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
