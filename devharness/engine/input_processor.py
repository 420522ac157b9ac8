"""InputProcessor: prompts and sampling params checked and made into Requests (vLLM v1's name), before anything
reaches the scheduler, so that a bad request never disturbs the others. Pure given the tokenizer and the model's
limits: AsyncLLM calls it on the caller's thread, off the engine loop."""
from __future__ import annotations

import itertools
import random

from devharness.engine.request import Request
from devharness.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, source, tokenizer, max_model_len: int, eos_token_ids, seed: int | None):
        """`source`: the resolved model (its name and arch); `seed`: the model config's, which the per-request seeds
        are drawn from when a request brings none."""
        self.source, self.tokenizer, self.max_model_len = source, tokenizer, max_model_len
        self.eos_token_ids = eos_token_ids
        self._seed_rng = random.Random(seed)
        self._ids = itertools.count()

    def process_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """A prompt as (text, token ids): a string, {"prompt_token_ids": [...]} or {"prompt": "..."}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                return self.process_prompt(prompt["prompt"])
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"model {self.source.name} has no tokenizer; pass {{'prompt_token_ids': [...]}}")
            try:
                text, ids = prompt, self.tokenizer.encode(prompt)
            except Exception as e:   # e.g. a lone surrogate, which the tokenizer cannot take
                raise ValueError(f"prompt cannot be tokenized: {type(e).__name__}: {e}") from None
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.source.arch.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; this model allows at most {self.max_model_len - 1} "
                             f"(max_model_len {self.max_model_len}, one token kept for the output)")
        return text, list(ids)

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone, as it needs the model."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, not {type(params).__name__}")
        vocab = self.source.arch.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids={params.stop_token_ids!r}: must be token ids "
                             f"in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"SamplingParams.logit_bias: token ids {sorted(t for t in params.logit_bias if t >= vocab)[:4]} "
                             f"are outside the vocabulary [0, {vocab})")

    def next_id(self) -> str:
        """An id for a request that brings none: the next number."""
        return str(next(self._ids))

    def make_request(self, ids: list[int], params: SamplingParams, request_id: str) -> Request:
        """The Request for checked token ids and params, with its seed: the request's, else the next one drawn from
        the model's seed."""
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        return Request(request_id, ids, params, seed, self.eos_token_ids, self.max_model_len)
