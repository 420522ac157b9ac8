"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names)."""
from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, kw_only=True):
    """Per-request sampling; checked when built, so a bad value fails before anything runs.

    temperature 0 is greedy. top_k None (or 0) and top_p 1.0 disable those filters. With `seed`
    the request's tokens depend only on the seed and the model, not on what it is batched with.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        def bad(field, value, rule):
            raise ValueError(f"SamplingParams.{field}={value!r}: {rule}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or self.temperature != self.temperature or self.temperature < 0:
            bad("temperature", self.temperature, "must be a number >= 0 (0 means greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0):
            bad("top_k", self.top_k, "must be None, 0 (disabled) or a positive integer")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad("seed", self.seed, "must be an integer")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", self.stop, "must be a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "must be a list of token ids >= 0")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", self.logprobs, "must be None or an integer in [0, 20]")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
