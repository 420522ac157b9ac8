"""What the engine, executors, workers and server say to each other: msgspec Structs only,
so a worker never imports the engine and a step message is encoded once per step."""
from __future__ import annotations

import posixpath
from typing import ClassVar, Union

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
    # With the KV sanitizer: each block's generation when the table got it (the worker checks it before reading).
    block_generations: list[int] = []
    # The engine's EOS ids, sent only while sampling must mask them (SamplingParams.min_tokens).
    eos_token_ids: list[int] = []


class CachedRequest(msgspec.Struct, array_like=True):
    """A request the workers hold already: only what changed since it was last scheduled.

    Sending the diff keeps the per-step message small at large batch; workers keep the rest.
    """

    req_id: str
    new_token_ids: list[int]
    new_block_ids: list[int]
    num_computed_tokens: int
    new_block_generations: list[int] = []   # with the KV sanitizer, as NewRequest.block_generations


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
    token_rank: int | None = None   # 1 + how many tokens were likelier (prompt logprobs, as vLLM reports them)


class PromptLogprobs(msgspec.Struct, array_like=True):
    """One request's prompt tokens scored by a prefill chunk: `logprobs[i]` is prompt token `first + i`'s."""

    req_id: str
    first: int
    logprobs: list[TokenLogprobs]


class RequestError(msgspec.Struct, array_like=True):
    """A failure that belongs to one request (its rows' inputs or sampling): that request ends, the step goes on."""

    req_id: str
    message: str     # names the rank and where: "rank 2 (tp 0, pp 1) failed preparing its inputs: ..."
    kind: str | None = None   # protocol/errors.py's NON_FINITE where the numerics check ended it


class NumericsAlarm(msgspec.Struct, kw_only=True):
    """The first non-finite value one rank's numerics check (debug/numerics.py) met in a step, in the order its
    sites ran: where (layer None: the logits), what it was, and the rows that held it there."""

    step: int
    rank: int
    tp_rank: int
    pp_rank: int
    layer: int | None
    site: str                     # fault_spec.LAYER_SITES or "logits"
    op: str                       # what wrote the value: "o_proj", "attention all_reduce", "lm_head", ...
    value: str                    # "nan", "inf" or "-inf": the first such row's
    rows: list[tuple[str, int]]   # (request id, token position) of each row holding it there


class NumericsStep(msgspec.Struct, array_like=True):
    """One step's absmax per site on one rank: `absmax[i]` is layer site `sites[i]`'s (NumericsReport.sites, in the
    order they ran), `logits` the sampled rows' logits' where they were computed (inf or nan where a row held one)."""

    step: int
    absmax: list[float]
    logits: float | None = None


class NumericsReport(msgspec.Struct):
    """A rank's numerics record: its layer sites as (layer, site), its absmax per site in its last steps, oldest
    first, and its alarms among them."""

    rank: int
    tp_rank: int = 0
    pp_rank: int = 0
    sites: list[tuple[int, str]] = []
    steps: list[NumericsStep] = []
    alarms: list[NumericsAlarm] = []


class KvAlarm(msgspec.Struct, array_like=True):
    """A KV checksum mismatch one rank found (debug/kv_checksums.py): a block whose keys and values are not what was
    written, or a prefix-cache hit on a block that holds other tokens. The driver ends the readers with `message`."""

    rank: int
    step: int
    block: int
    layer: int                  # the first layer that differs (a stale hit: the first of the rank's stage)
    readers: list[str]          # the requests that read the block in this step, or were handed it
    writer: str | None          # the request that wrote it (None: unknown)
    written_step: int | None
    message: str


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    """Sampled tokens, one per request whose scheduled tokens reached its end (partial prefills sample nothing),
    and the requests that failed on their own in this step (they sample nothing and are dropped by the workers)."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    failed: list[RequestError] = []
    # Only when recording: (max logit, logsumexp) of each sampled row, for replay to compare numerics.
    logits_digest: list[tuple[float, float]] | None = None
    # For requests with SamplingParams.prompt_logprobs whose prompt this step ran (partial prefills too).
    prompt_logprobs: list[PromptLogprobs] = []
    # With the numerics check: the output rank met a non-finite value in this step (the driver then asks every rank
    # where it was born: GetNumerics).
    numerics: NumericsAlarm | None = None
    # With the KV sanitizer: the checksum mismatches found in this step, by any rank (the driver gathers them).
    kv_alarms: list[KvAlarm] = []


EMPTY_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


# -- worker state and the /debug wire types (docs/design.md, "Worker state") ---------------------------
# What each rank publishes (see debug/state.py) and what /debug/* sends. Every field but the identity has a
# default and msgspec ignores fields it does not know, so a TUI built apart from the server (older or newer)
# still decodes what the server sends: a field missing or added degrades one cell's text, not the view.

PHASES = ("idle", "recv", "prepare", "forward", "collective", "sample", "send", "paused", "dead")


class DebugpyInfo(msgspec.Struct):
    host: str = "127.0.0.1"
    port: int | None = None
    client_connected: bool = False


class PausedInfo(msgspec.Struct):
    """Where a worker is stopped in a debugger."""

    reason: str = "breakpoint"   # "breakpoint" | "exception" | "waiting_for_client"
    file: str = ""
    line: int | None = None
    since: float | None = None

    @property
    def location(self) -> str:
        where = posixpath.basename(self.file.replace("\\", "/")) or "?"
        return where if self.line is None else f"{where}:{self.line}"


class WorkerState(msgspec.Struct):
    """What one rank is doing (docs/design.md, "Worker state"); `detail` says which layer and collective.
    The worker's recorder changes it in place."""

    rank: int
    tp_rank: int = 0
    pp_rank: int = 0
    node_ip: str = "?"
    pid: int | None = None
    debugpy: DebugpyInfo | None = None
    step: int = 0
    phase: str = "idle"
    detail: str | None = ""
    phase_since: float | None = None
    last_step_ms: float | None = None
    num_reqs: int = 0
    num_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    paused: PausedInfo | None = None
    alive: bool = True
    # The ranks this one waits on in its current collective / recv, or the wait in words.
    waiting_for: list[int] | str | None = None
    source_root: str | None = None   # the folder holding the devharness package the worker runs


class StepRecord(msgspec.Struct):
    """One finished step of one worker."""

    step: int
    phases: dict[str, float] = {}   # phase name -> ms, in the order the worker ran them
    total_ms: float | None = None
    num_tokens: int | None = None
    # Unix times the worker began (read the step message) and ended the step: with batches in flight,
    # stage 0 begins step i + 1 before the last stage ends step i.
    started_at: float | None = None
    ended_at: float | None = None


class LedgerGroup(msgspec.Struct, frozen=True):
    """A process group as torch names it: its name ("0" is the world), the description it was made with
    (default_pg, tp0, pp1...) and its global ranks."""

    name: str
    desc: str
    ranks: list[int]


class LedgerEntry(msgspec.Struct):
    """One collective or point-to-point op one rank made (debug/ledger.py). Sequence numbers count per group as
    Flight Recorder counts them: `collective_seq` for collectives (a p2p op carries the group's current one),
    `p2p_seq` for sends and receives. `state` is scheduled, started or completed; times are unix ns, 0 for
    not yet."""

    record_id: int
    group: str
    op: str                     # all_reduce, all_gather, send, recv
    collective_seq: int
    p2p_seq: int
    peer: int | None            # a send's destination, a receive's source (global ranks)
    step: int
    layer: int | None
    site: str                   # what the model calls it: "attention all_reduce", "activations to rank 2"
    in_shape: list[int]
    in_dtype: str
    out_shape: list[int]
    out_dtype: str
    state: str
    created_ns: int
    started_ns: int = 0
    completed_ns: int = 0

    @property
    def seq(self) -> int:
        return self.p2p_seq if self.op in ("send", "recv") else self.collective_seq

    def where(self) -> str:
        return f"layer {self.layer} {self.site}" if self.layer is not None else self.site

    def describe(self) -> str:
        """`all_reduce [8, 576] float32 at layer 3 mlp all_reduce`"""
        return f"{self.op} {self.in_shape} {self.in_dtype} at {self.where()}"


class Ledger(msgspec.Struct):
    """One rank's collective ledger as read from outside: its groups (world, TP group, PP group), the newest
    entries oldest first, and how many it has entered in all (the ring keeps the last `capacity`)."""

    rank: int
    backend: str = "gloo"
    async_ops: bool = False
    groups: list[LedgerGroup] = []
    entries: list[LedgerEntry] = []
    count: int = 0
    capacity: int = 0


class EngineStats(msgspec.Struct):
    """The engine as /debug reports it: steps it ran, its queues and KV cache."""

    step: int = 0
    state: str = "running"   # "running" | "paused" | "restarting" | "stopped" | "dead"
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    tokens_per_s: float | None = None
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    last_step_ms: float | None = None
    batches_in_flight: int = 0  # steps sent to the workers whose output has not come back
    hang: str | None = None     # the hang the engine's detector reported, until its step went on (diagnostics/hang.py)
    bundle: str | None = None   # the last bundle written (diagnostics/bundle.py): its directory
    time: float | None = None   # the server's unix time, where a server puts it here rather than in Snapshot
    # The stalls the detector reported (engine/request_story.py) that still hold: their request waits or runs, or
    # the queue is still idle. Each described: "request ID KIND: DETAIL (step S)".
    stalls: list[str] = []


# -- the KV cache as the driver's block manager holds it: GET /debug/kv, `devharness kv`, the TUI's KV view -------

class KvEvent(msgspec.Struct):
    """One thing the block manager did. `kind`: allocate (blocks handed to a request), free (a request gave its
    blocks back), lookup (a prefix-cache lookup: `detail` says what hit and why the first miss missed), evict (a
    free block holding a cached prefix was taken for new tokens), preempt (a request lost its blocks, to be
    computed again)."""

    step: int
    kind: str
    request: str | None = None
    blocks: list[int] = []
    detail: str = ""


class KvRequest(msgspec.Struct):
    """One running or waiting request's share of the cache."""

    request: str
    status: str                   # running | waiting | preempted
    blocks: list[int]             # its block table
    num_computed_tokens: int
    num_tokens: int
    prefix_hit_blocks: int        # blocks it found in the prefix cache when it was admitted


class KvSnapshot(msgspec.Struct):
    """The block manager's state at the end of step `step`: block b's reference count, the hash it is cached
    under (hex, or None) and its generation (it changes each time the block is taken for new tokens)."""

    step: int
    num_blocks: int
    block_size: int
    prefix_caching: bool
    num_free: int                 # reference count 0 (cached ones included: they are evictable)
    num_used: int                 # reference count > 0
    num_cached: int               # free blocks that still hold a cached prefix
    usage: float                  # num_used / num_blocks (vLLM's kv_cache_usage_perc)
    ref_counts: list[int]
    hashes: list[str | None]
    generations: list[int]
    requests: list[KvRequest]
    events: list[KvEvent]
    prefix_queries: int           # tokens looked up in the prefix cache (vLLM's prefix_cache_queries)
    prefix_hits: int              # tokens found there (vLLM's prefix_cache_hits)
    preemptions: int
    sanitizer: bool               # whether the KV sanitizer checks every step
    time: float | None = None     # the server's unix time when it was read


# -- each request's story as the scheduler tells it: GET /debug/requests[/{id}], `devharness requests` ------------

class WaitingReason(msgspec.Struct):
    """Why a waiting request was not scheduled in the last step. `code`: kv-blocks (too few free KV blocks), max-num-seqs
    (the running requests fill max_num_seqs), token-budget (the step's token budget is spent), batch-queue (every batch
    slot of the pipeline is in flight, or this batch holds its share of the requests), paused (the engine is paused),
    behind (an earlier waiting request blocks it: first come, first served). `detail`: the numbers, in words."""

    code: str
    detail: str


class StoryEvent(msgspec.Struct):
    """One thing that happened to a request. `kind`: arrive, wait (passed over: `count` steps in a row from `step` to
    `last_step` with `detail`'s reason; the same reason again only extends it), admit, chunk (a prefill chunk of
    `tokens` tokens), preempt (`blocks` blocks freed), first-token, finish, abort."""

    kind: str
    step: int
    detail: str = ""
    last_step: int | None = None
    count: int = 1
    tokens: int | None = None
    blocks: int | None = None
    time: float | None = None


class RequestStory(msgspec.Struct):
    """One request from the scheduler's side. `state`: waiting | running | preempted (waiting again after a
    preemption) | finished | aborted; `queued_s`: the seconds it has spent waiting, all its waits together."""

    request_id: str
    state: str
    waiting_reason: WaitingReason | None
    arrival_time: float
    queued_s: float
    num_preemptions: int
    prefix_hit_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    first_token_step: int | None = None
    finish_reason: str | None = None
    events: list[StoryEvent] = []   # only in GET /debug/requests/{id}


class Stall(msgspec.Struct):
    """A request that does not get on. `kind`: passed-over (it fits, yet was passed over `steps` steps in a row),
    idle-queue (requests wait and nothing runs, the engine not paused, for `detail`'s seconds), thrash (preempted
    more than the limit: `steps` times)."""

    request_id: str | None
    kind: str
    steps: int
    reason: str
    detail: str
    step: int = 0
    time: float | None = None


class RequestsSnapshot(msgspec.Struct):
    """GET /debug/requests: the running and waiting requests (oldest first), then the last finished ones, and
    the stalls seen so far (the newest last)."""

    step: int
    paused: bool
    requests: list[RequestStory]
    stalls: list[Stall]
    time: float | None = None


class DriverStep(msgspec.Struct, array_like=True):
    """One step as the driver ran it (unix times, seconds): scheduled (the scheduling pass began), sent (the step
    message handed to the executor), done (its output back), applied (the scheduler updated from it; None while
    it runs); `tokens`: each request's scheduled tokens, in the step's order."""

    step: int
    scheduled: float
    sent: float
    done: float | None = None
    applied: float | None = None
    tokens: dict[str, int] = {}


class DriverTimeline(msgspec.Struct):
    """`GET /debug/driver` and a bundle's driver.json: the driver's last steps (oldest first) and the stories, events
    included, of the requests the engine still holds (running, waiting and the last finished)."""

    steps: list[DriverStep]
    requests: list[RequestStory]
    # Each rank's clock less the driver's (ns), measured at start-up, and half the round trip it was measured over:
    # devharness trace subtracts the offset from the rank's times (one clock for ranks on other nodes).
    clock_offsets_ns: dict[int, int] = {}
    clock_uncertainty_ns: dict[int, int] = {}


class BundleWritten(msgspec.Struct):
    """`POST /debug/bundle`: where the server wrote the bundle, its name for `GET /debug/bundle/NAME`, its files."""

    path: str
    name: str
    files: list[str] = []


class Snapshot(msgspec.Struct):
    """`GET /debug/workers` and each `/debug/stream` event."""

    engine: EngineStats = msgspec.field(default_factory=EngineStats)
    workers: list[WorkerState] = []
    time: float | None = None   # the server's unix time, to correct for clock skew
    kv: KvSnapshot | None = None   # the KV cache map, in `/debug/stream?kv=1` events

    @property
    def server_time(self) -> float | None:
        return self.time if self.time is not None else self.engine.time


# -- control: the driver's calls to workers, each with the type of its reply --------------------------
# Every backend carries them the same way (msgpack out, msgpack back), so a reply is the same type
# everywhere: Executor.control(call) returns one `call.Reply` per rank. The tag names the Worker method
# that answers it, with the call's fields as arguments.

class BreakpointSpec(msgspec.Struct, kw_only=True):
    """Where to stop: every field is optional; a spec matches where all its set fields match."""

    rank: int | None = None
    tp_rank: int | None = None
    pp_rank: int | None = None
    step: int | None = None          # None: the next step
    request_id: str | None = None
    layer: int | None = None

    def matches_worker(self, st: WorkerState) -> bool:
        return all(want is None or want == have for want, have in
                   ((self.rank, st.rank), (self.tp_rank, st.tp_rank), (self.pp_rank, st.pp_rank)))


class Ping(msgspec.Struct, tag="ping"):
    Reply: ClassVar = int                 # the rank


class ReadClock(msgspec.Struct, tag="read_clock"):
    """The worker's wall clock now (unix ns): the driver aligns the clocks of ranks on other nodes with it."""
    Reply: ClassVar = int


class InitDevice(msgspec.Struct, tag="init_device"):
    """Set up the device and join the process groups: every rank at once."""
    Reply: ClassVar = None


class LoadModel(msgspec.Struct, tag="load_model"):
    Reply: ClassVar = None


class KvCacheBlockBytes(msgspec.Struct, tag="kv_cache_block_bytes"):
    Reply: ClassVar = int


class WeightFormat(msgspec.Struct, frozen=True, omit_defaults=True):
    """How the weights are held. `kind`: "as shipped" (some kept in a GGUF file's quantized blocks; `blocks`: ggml
    type -> how many of the file's tensors it holds in them, q, k and v each counted, a tied LM head apart from the
    embedding), "dequantized" (a GGUF file's quantized weights as float: --dequantize, or no quantized kernels here)
    or "float" (float weights as stored); `bytes`: the memory they take. One rank's (`tp_rank` set: the reply to
    GetWeightFormat) or the engine's (every rank's, `merged`)."""

    kind: str
    blocks: dict[str, int] = {}
    bytes: int = 0
    tp_rank: int | None = None

    def summary(self) -> str:
        """The format in words, without the memory: what a replay compares with its recording's."""
        if not self.blocks:
            return self.kind
        return f"{self.kind} ({', '.join(f'{n} {t}' for t, n in self.blocks.items())} tensors in their blocks)"

    def describe(self) -> str:
        return f"{self.summary()}, {self.bytes / 2**20:.1f} MiB"

    @classmethod
    def merged(cls, ranks: list["WeightFormat"]) -> "WeightFormat":
        """The engine's, from each rank's: tensors counted once per pipeline stage (the tp ranks of a stage hold
        shards of the same ones), bytes summed over every rank."""
        blocks: dict[str, int] = {}
        for r in ranks:
            if r.tp_rank == 0:
                for t, n in r.blocks.items():
                    blocks[t] = blocks.get(t, 0) + n
        kinds = {r.kind for r in ranks}
        kind = "as shipped" if blocks else "dequantized" if "dequantized" in kinds else "float"
        return cls(kind, dict(sorted(blocks.items())), sum(r.bytes for r in ranks))


class GetWeightFormat(msgspec.Struct, tag="get_weight_format"):
    """How this rank holds its weights (after LoadModel)."""
    Reply: ClassVar = WeightFormat


class InitKvCache(msgspec.Struct, tag="init_kv_cache"):
    num_blocks: int
    Reply: ClassVar = None


class GetState(msgspec.Struct, tag="get_state"):
    Reply: ClassVar = WorkerState


class GetHistory(msgspec.Struct, tag="get_history"):
    Reply: ClassVar = list[StepRecord]


class GetStack(msgspec.Struct, tag="get_stack"):
    """Every thread's Python stack, from inside (the worker must answer; py-spy reads it from outside)."""
    Reply: ClassVar = str


class ArmBreakpoint(msgspec.Struct, tag="arm_breakpoint"):
    spec: BreakpointSpec
    Reply: ClassVar = bool                # kept: the spec names this worker


class ClearBreakpoints(msgspec.Struct, tag="clear_breakpoints"):
    Reply: ClassVar = int                 # how many were armed


class ArmFault(msgspec.Struct, tag="arm_fault"):
    """Raise at the step (and layer) `spec` names, once: exercises failure and post-mortem on purpose."""
    spec: BreakpointSpec
    Reply: ClassVar = bool


class ArmRequestFault(msgspec.Struct, tag="arm_request_fault"):
    """Fail one request's rows where it is prepared ("prepare") or sampled ("sample")."""
    request_id: str
    where: str = "prepare"
    Reply: ClassVar = bool


class ArmCapture(msgspec.Struct, tag="arm_capture"):
    """Keep every layer's attention output, MLP output and residual stream, and a TP rank's partial sums, in
    every step until TakeCapture (`devharness check`). `split`: a tp=1 worker also computes the partial sums
    that `split` TP shards would produce from their slices of its weights (the reference for tp=split).
    `ops`: keep instead every kernel op's output, split by request (`requests`: only these; None: all);
    `alone`: and run each kept request's rows of a call that holds other rows again through the op alone.
    Either way also each step's logits of its sampled rows (site "logits": a flipped token's margin)."""
    split: int | None = None
    ops: bool = False
    requests: list[str] | None = None
    alone: bool = False
    Reply: ClassVar = None


class CapturedTensor(msgspec.Struct, frozen=True, array_like=True):
    """One activation kept by ArmCapture, as float32 bytes in row-major order."""
    step: int              # forwards since ArmCapture: 0 is the first
    layer: int
    site: str              # "attention" | "mlp" (a row-parallel projection) | "residual" (the stream after the layer)
                           # | "logits" (layer -1: the step's logits of its sampled rows, on every last-stage rank)
    shard: int | None      # None: the full tensor; else TP shard `shard`'s partial sum before the all-reduce
    shape: list[int]
    data: bytes
    # Kept by op (ArmCapture(ops=True)): site is "attention" | "mlp" | "final" (the last norm) | "head" (the LM
    # head and sampling), `op` the registry's name, `call` its index among that op's calls in the layer and site,
    # the rows those of `request`, the first at token position `position` (a head op's rows: its sampled row).
    op: str | None = None
    call: int = 0
    request: str | None = None
    position: int = 0
    alone_diff: float | None = None   # ArmCapture(alone=True): these rows in their call vs run alone (rel diff)


class TakeCapture(msgspec.Struct, tag="take_capture"):
    """What ArmCapture kept since, and disarm."""
    Reply: ClassVar = list[CapturedTensor]


class GetCollectives(msgspec.Struct, tag="get_collectives"):
    """The worker's collective ledger (for a worker whose shared memory the driver cannot read)."""
    Reply: ClassVar = Ledger


class InjectFault(msgspec.Struct, tag="inject_fault"):
    """Plant the fault `spec` (debug/faults.py, as `--inject` takes it) from now on, replacing one planted
    before; None removes it."""
    spec: str | None = None
    Reply: ClassVar = bool                # planted on this rank


class GetNumerics(msgspec.Struct, tag="get_numerics"):
    """The worker's numerics record (NumericsReport): its last steps' absmax per site and its alarms."""
    Reply: ClassVar = NumericsReport


class ProfileCalls(msgspec.Struct):
    """One recorder method under a "recorder-calls" profile: its calls (a call made from inside another, as
    set_phase calls enter, counts with the outer one only) and the seconds spent in them."""
    calls: int = 0
    seconds: float = 0.0


class ProfileResult(msgspec.Struct):
    """What one rank's profiler measured between StartProfile and StopProfile (debug/profiler.py)."""

    kind: str
    rank: int
    steps: int = 0            # steps this rank ran under the profile
    # "state-ab", "ledger-ab": per pair of neighbouring steps, the one without what the kind turns off and on
    # (even step) and the one with it (the odd step after), each step's thread CPU time in us.
    pairs_us: list[tuple[float, float]] = []
    # "recorder-calls": per StateRecorder method; "kv-checksums": "steps" and "checksums" (calls, thread CPU seconds),
    # "blocks checksummed" and "blocks verified" (counts, as calls)
    calls: dict[str, ProfileCalls] = {}
    trace: str | None = None  # "torch": the Chrome trace this rank wrote


class StartProfile(msgspec.Struct, tag="start_profile"):
    """Run a profiler around this worker's steps until StopProfile (debug/profiler.py names the kinds): "torch"
    writes a Chrome trace per rank into `trace_dir`; "state-ab", "ledger-ab" and "recorder-calls" measure what
    the worker's state publishing costs. `stand_ins` ("recorder-calls" only): the recorder's methods replaced by
    do-nothing stand-ins, timed alike. An unknown kind, an argument the kind does not take, or a profile
    already running is a ValueError."""
    kind: str
    trace_dir: str | None = None
    stand_ins: bool = False
    Reply: ClassVar = None


class StopProfile(msgspec.Struct, tag="stop_profile"):
    """End the profile StartProfile began (a ValueError when none runs); what it measured."""
    Reply: ClassVar = ProfileResult


ControlCall = Union[Ping, ReadClock, InitDevice, LoadModel, KvCacheBlockBytes, GetWeightFormat, InitKvCache,
                    GetState, GetHistory, GetStack, ArmBreakpoint, ClearBreakpoints, ArmFault, ArmRequestFault,
                    ArmCapture, TakeCapture, InjectFault, GetCollectives, StartProfile, StopProfile, GetNumerics]
CONTROL_CALLS: tuple[type, ...] = ControlCall.__args__

