"""LLM: the offline Python API, with vLLM's names."""
from __future__ import annotations

from collections.abc import Sequence

from devharness.protocol.errors import NON_FINITE, NonFiniteError
from devharness.engine.args import EngineArgs
from devharness.engine.output import RequestOutput
from devharness.engine.runner import EngineRunner
from devharness.protocol.messages import ProfileResult
from devharness.sampling_params import SamplingParams


class LLM:
    """Load a model on a tp x pp grid of workers and generate; `with LLM(...) as llm:` shuts it down."""

    def __init__(self, model: str | None = None, **kwargs):
        """`model`: as EngineArgs' (default: its default); `kwargs`: EngineArgs' other fields (tensor_parallel_size,
        distributed_executor_backend, seed, debug, ...)."""
        if model is not None:
            kwargs["model"] = model
        # The runner starts the engine, owns its life and steps it, here on the caller's thread (run_until_idle), as
        # on the server's engine thread: a failed step, a restart and a shutdown go through the same code.
        self.runner = EngineRunner.start(EngineArgs.from_kwargs(**kwargs).create_engine_config())
        self.engine = self.runner.engine
        self.config = self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. All inputs are checked first.

        The engine steps here, on the caller's thread (EngineRunner.run_until_idle), not on an engine loop: no thread
        hop per call, nothing runs on the workers between calls (no liveness checks, no restart in the background),
        and a failed step raises its own error, with the runner's account of it as a note (what a served request
        ends with), after the runner has done what its state machine decided (a restart included). A request the
        numerics check ended (a nan or inf in its rows) raises NonFiniteError naming where it was born, once every
        prompt finished; the error's `outputs` holds them all."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        processed = [self.engine.input_processor.process_prompt(p) for p in prompts]
        ids: list[str] = []
        pending: set[str] = set()
        try:
            for (text, tok), sp in zip(processed, params):   # one refused: none of them runs
                ids.append(self.engine.add_processed(text, tok, sp))
                pending.add(ids[-1])
            finals = self.runner.run_until_idle(pending)
        except BaseException:
            for rid in pending:   # what a restart ended is gone from `pending` already
                self.engine.abort_request(rid)
            raise
        outputs = [finals[i] for i in ids]
        for out in outputs:   # the numerics check ended it: the other prompts finished, and come with the error
            if out.outputs[0].error_kind == NON_FINITE:
                raise NonFiniteError(out.outputs[0].error, outputs)
        return outputs

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
        return {**self.engine.stats(), **self.runner.live_stats()}

    def shutdown(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.runner.stop("the LLM was shut down")
            self.runner.shutdown()
            self.engine = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
