"""LLM: the offline Python API, with vLLM's names."""
from __future__ import annotations

from collections.abc import Sequence

from devharness.config import DebugConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from devharness.engine.llm_engine import LLMEngine
from devharness.engine.output import RequestOutput
from devharness.sampling_params import SamplingParams


class LLM:
    """Load a model on a tp x pp grid of workers and generate; `with LLM(...) as llm:` shuts it down."""

    def __init__(self, model: str = "tiny-llama", *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 distributed_executor_backend: str | None = None, seed: int = 0, dtype: str = "float32",
                 max_model_len: int | None = None, debug: bool | DebugConfig = False, device: str = "cpu",
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 1024, block_size: int = 16,
                 kv_cache_memory_bytes: int = 512 * 1024 * 1024, num_kv_blocks: int | None = None,
                 enable_prefix_caching: bool = True, **parallel_kwargs):
        debug_cfg = debug if isinstance(debug, DebugConfig) else DebugConfig(enabled=bool(debug))
        self.config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, device=device),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                    pipeline_parallel_size=pipeline_parallel_size,
                                    distributed_executor_backend=distributed_executor_backend, **parallel_kwargs),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      block_size=block_size, kv_cache_memory_bytes=kv_cache_memory_bytes,
                                      num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching),
            debug=debug_cfg)
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
            while pending:
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                        pending.discard(out.request_id)
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
