"""Request: one prompt's life in the engine, as the scheduler sees it."""
from __future__ import annotations

import enum
import time

import msgspec

from devharness.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # Failed on its own (a worker could not prepare or sample its rows, its step message could not be
    # encoded): Request.error says why; the other requests go on.
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


class Request:
    """Token ids, progress through the KV cache, and why it stopped."""

    def __init__(self, req_id: str, prompt_token_ids: list[int], sampling: SamplingParams, sampling_seed: int,
                 eos_token_ids: tuple[int, ...], max_model_len: int):
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling = sampling
        self.sampling_seed = sampling_seed
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.stop_token_ids = frozenset(sampling.stop_token_ids)   # looked up after every token
        # What the workers get: stop strings are the engine's business (engine/output.py), so they stay here.
        self.worker_sampling = msgspec.structs.replace(sampling, stop=[]) if sampling.stop else sampling
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # How many of all_token_ids the workers hold: the next step sends only the rest.
        self.num_tokens_sent = 0
        self.num_cached_tokens: int | None = None   # prefix-cache hit at first schedule
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.error: str | None = None           # why it ended with FINISHED_ERROR
        self.error_kind: str | None = None      # RequestError.kind of that error
        self.arrival_time = time.time()
        self.first_token_time: float | None = None
        self.queued_s = 0.0   # seconds spent waiting to be scheduled, as of its last admission (request_story.py)
        # SamplingParams.prompt_logprobs: prompt token i's at index i (the first token's None), filled as prefill runs
        self.prompt_logprobs: list | None = [None] if sampling.prompt_logprobs is not None else None

    def add_prompt_logprobs(self, first: int, logprobs: list) -> None:
        """Prompt tokens first.. scored by a prefill chunk; a chunk run again (after preemption) adds nothing."""
        have = len(self.prompt_logprobs)
        if first <= have:
            self.prompt_logprobs.extend(logprobs[have - first:])

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """After a new token: set a finished status if a token-level stop condition holds."""
        tok = self.output_token_ids[-1]
        if not self.sampling.ignore_eos and tok in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
        elif tok in self.stop_token_ids:
            self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, tok
        elif len(self.output_token_ids) >= self.sampling.max_tokens or self.num_tokens >= self.max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
        return self.status.finished
