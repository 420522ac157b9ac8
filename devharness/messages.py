"""What the engine, executors, workers and server say to each other: msgspec Structs only,
so a worker never imports the engine and a step message is encoded once per step."""
from __future__ import annotations

import msgspec

from devharness.sampling_params import SamplingParams


class NewRequest(msgspec.Struct, array_like=True):
    """A request a worker has not seen (or must rebuild after preemption): sent whole."""

    req_id: str
    token_ids: list[int]          # prompt plus any output tokens so far (a resumed request)
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int      # tokens whose KV is already in the cache (prefix-cache hits)
    sampling: SamplingParams
    sampling_seed: int


class CachedRequest(msgspec.Struct, array_like=True):
    """A request the workers hold already: only what changed since it was last scheduled.

    Sending the diff keeps the per-step message small at large batch; workers keep the rest.
    """

    req_id: str
    new_token_ids: list[int]
    new_block_ids: list[int]
    num_computed_tokens: int


class SchedulerOutput(msgspec.Struct, array_like=True):
    """One engine step: what every worker runs. Requests run in the order of `num_scheduled_tokens`."""

    step: int
    new_requests: list[NewRequest]
    cached_requests: list[CachedRequest]
    num_scheduled_tokens: dict[str, int]
    # Finished or preempted since the last step: workers drop their state.
    finished_req_ids: list[str]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class TokenLogprobs(msgspec.Struct, array_like=True):
    token_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    """Sampled tokens, one per request whose scheduled tokens reached its end (partial prefills sample nothing)."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None


EMPTY_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
