"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names)."""
from __future__ import annotations

import math

import msgspec

# The engine carries these in msgpack step messages and int64 tensors, which stop at 64 bits.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


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

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_finite(v):
            try:
                return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            except OverflowError:   # an int past float's range
                return False

        if not is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX:
            bad("max_tokens", self.max_tokens, f"must be an integer in [1, {INT64_MAX}]")
        if not is_finite(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, "must be a finite number >= 0 (0 means greedy)")
        if not is_finite(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "must be a finite number in (0, 1]")
        if self.top_k is not None and (not is_int(self.top_k) or not 0 <= self.top_k <= INT64_MAX):
            bad("top_k", self.top_k, f"must be None, 0 (disabled) or a positive integer <= {INT64_MAX}")
        if self.seed is not None and (not is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            bad("seed", self.seed, f"must be an integer in [{INT64_MIN}, {INT64_MAX}] (64 bits)")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", self.stop, "must be a list of non-empty strings")
        for s in self.stop:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                bad("stop", self.stop, f"must be valid Unicode text, but {s!r} has a lone surrogate at index {e.start}")
        if not all(is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, f"must be a list of token ids in [0, {INT64_MAX}]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", self.logprobs, "must be None or an integer in [0, 20]")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
