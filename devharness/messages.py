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


class RequestError(msgspec.Struct, array_like=True):
    """A failure that belongs to one request (its rows' inputs or sampling): that request ends, the step goes on."""

    req_id: str
    message: str     # names the rank and where: "rank 2 (tp 0, pp 1) failed preparing its inputs: ..."


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    """Sampled tokens, one per request whose scheduled tokens reached its end (partial prefills sample nothing),
    and the requests that failed on their own in this step (they sample nothing and are dropped by the workers)."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    failed: list[RequestError] = []


EMPTY_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


# -- worker state (DESIGN.md §3): what each rank publishes, see debug/state.py ------------------------

PHASES = ("idle", "recv", "prepare", "forward", "collective", "sample", "send", "paused", "dead")


class DebugpyInfo(msgspec.Struct):
    host: str
    port: int
    client_connected: bool = False


class PausedInfo(msgspec.Struct):
    reason: str            # "breakpoint" | "exception" | "waiting_for_client"
    file: str
    line: int
    since: float


class WorkerState(msgspec.Struct):
    """What one rank is doing (DESIGN.md §3); `detail` says which layer and collective."""

    rank: int
    tp_rank: int
    pp_rank: int
    node_ip: str
    pid: int
    debugpy: DebugpyInfo | None = None
    step: int = 0
    phase: str = "idle"
    detail: str = ""
    phase_since: float = 0.0
    last_step_ms: float | None = None
    num_reqs: int = 0
    num_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    paused: PausedInfo | None = None
    alive: bool = True
    waiting_for: list[int] | None = None   # ranks this one waits on in its current collective / recv
    source_root: str | None = None         # the folder holding the devharness package the worker runs


class StepRecord(msgspec.Struct, array_like=True):
    """One finished step of one worker: time spent in each phase, ms."""

    step: int
    phases: dict[str, float]
    total_ms: float
    num_tokens: int


# The file: a header, the phase word, the site table, two record slots.
#
# The record (msgpack WorkerState) is written at step boundaries and pauses; the reader takes the slot
# the sequence number points at and retries if the writer moved on meanwhile (a seqlock over two slots).
# Phase changes inside a step (a few a layer: every collective is entered and left) write only the
# phase word, one aligned 8-byte store: the time since `base` in microseconds, the site (which phase,
# detail and peers, from the site table) and whether the worker has left it. The code right after a
# collective's wait runs on cold caches: the less it does the better, and one store is the least.
