"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names)."""
from __future__ import annotations

import math

import msgspec

from devharness.config import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                               MAX_STOP_TOKEN_IDS, MAX_STOP_TOTAL_CHARS)

# The engine carries these in msgpack step messages and int64 tensors, which stop at 64 bits.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


class SamplingParamsError(ValueError):
    """A value SamplingParams refuses; `field` names it (the server's 400 names it as `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


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
    # vLLM's extensions, with vLLM's meanings:
    min_tokens: int = 0                    # EOS and stop_token_ids are masked (stop strings unchecked) before this many
    repetition_penalty: float = 1.0        # > 1 discourages every token already in the prompt or the output
    logit_bias: dict[int, float] = {}      # token id -> added to its logit before sampling
    include_stop_str_in_output: bool = False   # keep the stop string (or the stop token's text) in the text
    spaces_between_special_tokens: bool = True   # as transformers' fast tokenizers: no effect on their decode
    prompt_logprobs: int | None = None     # each prompt token's logprob and its top-k (the first token's None)

    def __post_init__(self):
        def bad(field, value, rule):
            raise SamplingParamsError(field, f"SamplingParams.{field}={value!r}: {rule}")

        def too_many(field, count, what, limit, name):
            raise SamplingParamsError(field, f"SamplingParams.{field}=<{count} {what}>: at most {limit} ({name})")

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
        # Bounded (config.py): stop matching costs each new character a look at every stop length up to the longest.
        if len(self.stop) > MAX_STOP_STRINGS:
            too_many("stop", len(self.stop), "stop strings", MAX_STOP_STRINGS, "MAX_STOP_STRINGS")
        for s in self.stop:
            if len(s) > MAX_STOP_STRING_CHARS:
                bad("stop", _short(s), f"a stop string of {len(s)} characters; at most {MAX_STOP_STRING_CHARS} "
                                       "(MAX_STOP_STRING_CHARS)")
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                bad("stop", self.stop, f"must be valid Unicode text, but {s!r} has a lone surrogate at index {e.start}")
        total = sum(len(s) for s in self.stop)
        if total > MAX_STOP_TOTAL_CHARS:
            too_many("stop", total, "characters of stop strings", MAX_STOP_TOTAL_CHARS, "MAX_STOP_TOTAL_CHARS")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            too_many("stop_token_ids", len(self.stop_token_ids), "token ids", MAX_STOP_TOKEN_IDS, "MAX_STOP_TOKEN_IDS")
        if not all(is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, f"must be a list of token ids in [0, {INT64_MAX}]")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", self.logprobs, f"must be None or an integer in [0, {MAX_LOGPROBS}] (MAX_LOGPROBS)")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", self.prompt_logprobs,
                f"must be None or an integer in [0, {MAX_LOGPROBS}] (MAX_LOGPROBS)")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT64_MAX:
            bad("min_tokens", self.min_tokens, f"must be an integer in [0, {INT64_MAX}]")
        if not is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", self.repetition_penalty, "must be a finite number > 0 (1 means none)")
        if isinstance(self.logit_bias, dict) and len(self.logit_bias) > MAX_LOGIT_BIAS:
            too_many("logit_bias", len(self.logit_bias), "token ids", MAX_LOGIT_BIAS, "MAX_LOGIT_BIAS")
        if not isinstance(self.logit_bias, dict) or not all(
                is_int(t) and 0 <= t <= INT64_MAX and is_finite(b) and -100 <= b <= 100 for t, b in self.logit_bias.items()):
            bad("logit_bias", self.logit_bias, "must map token ids to finite numbers in [-100, 100]")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.repetition_penalty = float(self.repetition_penalty)
        self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def changes_logits(self) -> bool:
        """Whether sampling reads processed logits (a penalty, a bias, EOS masked), not the model's own."""
        return self.repetition_penalty != 1.0 or bool(self.logit_bias) or self.min_tokens > 0


def _short(s: str, keep: int = 40) -> str:
    """A long value as an error message quotes it: its start and its length."""
    return s if len(s) <= keep else f"{s[:keep]}... ({len(s)} characters)"
