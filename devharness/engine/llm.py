"""LLM: the offline Python API, with vLLM's names."""
from __future__ import annotations

from collections.abc import Sequence

from devharness.engine.args import EngineArgs
from devharness.engine.llm_engine import LLMEngine
from devharness.engine.output import RequestOutput
from devharness.sampling_params import SamplingParams


class LLM:
    """Load a model on a tp x pp grid of workers and generate; `with LLM(...) as llm:` shuts it down."""

    def __init__(self, model: str = "tiny-llama", **kwargs):
        """`kwargs`: EngineArgs' fields (tensor_parallel_size, distributed_executor_backend, seed, debug, ...)."""
        self.config = EngineArgs.from_kwargs(model=model, **kwargs).create_engine_config()
        self.engine = LLMEngine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. All inputs are checked first."""
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
                # A batch may still be in flight (one that tells the workers to drop finished requests): it ends
                # here, so that nothing runs on the workers between calls.
                while self.engine.core.num_batches_in_flight:
                    self.engine.step()
            except Exception as e:
                if not self.config.parallel.restart_workers:
                    raise
                # This call fails all the same; the next one finds a fresh set of workers.
                self.engine.restart_workers(f"{type(e).__name__}: {e}")
                pending.clear()
                raise
        except BaseException:
            for rid in pending:
                self.engine.abort_request(rid)
            raise
        return [finals[i] for i in ids]

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

    def stats(self) -> dict:
        return self.engine.stats()

    def shutdown(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()
            self.engine = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
