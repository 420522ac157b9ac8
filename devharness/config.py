"""Engine configuration: every engine option is declared here once, as a field of one config struct with its
default, its help text (an `Option` in its annotation) and its check (`__post_init__`, a ValueError naming field,
value and fix). `EngineArgs`, `LLM(...)`'s keywords and the CLI's flags are derived from these fields
(engine/args.py): a new option is one field here."""
from __future__ import annotations

import argparse
import ipaddress
import re
from dataclasses import dataclass
from typing import Annotated, Callable

import msgspec

from devharness.fault_spec import parse as parse_fault_spec

EXECUTOR_BACKENDS = ("uni", "mp", "ray")
RAY_CONTROL_PLANES = ("shm", "cgraph")
DTYPES = ("float32", "bfloat16", "float16")
# The kernel backends (devharness/kernels): every op's plain-torch reference, or the fast kernels (the default).
KERNEL_BACKENDS = ("reference", "fast")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class Option:
    """How a config field is offered to users. `flag`: its CLI flag (default `--field-name`); `group`: None for
    every command that builds an engine, else the name of the flag group a command asks for ("debug", "record",
    "restart"); `parse`: the argparse type where the field's own type is not one (a list); `internal`: set by the
    engine itself, neither a keyword nor a flag."""

    help: str
    flag: str | None = None
    group: str | None = None
    metavar: str | None = None
    choices: tuple | None = None
    parse: Callable | None = None
    internal: bool = False


def _ranks(text: str) -> list[int]:
    try:
        return sorted({int(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--debug-wait expects comma-separated ranks like 0,1, not {text!r}") from None


def _layer_counts(text: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pp-layer-partition expects comma-separated layer counts like "
                                         f"19,11, not {text!r}") from None


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expects an integer >= 1, not {text!r}")
    return value


# The debug listeners' ports: rank r listens on DEBUG_PORT_BASE + r unless told otherwise.
DEBUG_PORT_BASE = 5678
# Where `devharness serve` listens unless told otherwise, and where the commands that watch it look.
SERVER_PORT = 8000
# How many unfinished choices (engine requests: n per prompt) `devharness serve` holds before it answers 429 with
# Retry-After, unless told otherwise.
MAX_PENDING_REQUESTS = 1024
# A client that stops sending mid-request is cut off (server/timeouts.py), so that stalled clients cannot hold every
# connection: a body with no new part for REQUEST_BODY_IDLE_S, or not all in after REQUEST_BODY_TOTAL_S, is answered
# 408; a request's headers not all in REQUEST_HEADERS_S after the connection opened (or its last response) close it.
REQUEST_BODY_IDLE_S = 30.0
REQUEST_BODY_TOTAL_S = 120.0
REQUEST_HEADERS_S = 30.0

# What one request may ask for, so that it bounds the memory, the reply and the engine thread's work it costs (every
# other request waits on that thread). SamplingParams refuses past these (ValueError), the server with a 400 naming
# the limit; docs/http.md ("Limits") states them.
MAX_LOGPROBS = 20               # top logprobs per token (vLLM's default max_logprobs)
MAX_CHOICES = 128               # n times the prompts of one request (OpenAI caps n at 128)
MAX_LOGPROB_ENTRIES = 2**18     # logprobs in one reply: tokens scored times (top k + 1), over its choices
MAX_STOP_STRINGS = 1024
MAX_STOP_STRING_CHARS = 256     # each: stop matching looks this far back, per new character
MAX_STOP_TOTAL_CHARS = 2**16    # all of them together
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024           # token ids with a bias (OpenAI allows 300)


def _check_otlp_url(url) -> None:
    """An OTLP/HTTP endpoint: http or https, a host, a valid port, no query or fragment."""
    from urllib.parse import urlsplit
    rule = "must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:4318/v1/traces"
    if not isinstance(url, str) or any(c.isspace() for c in url):
        _bad("EngineConfig", "otlp_traces_endpoint", url, rule)
    try:
        parts = urlsplit(url)
        parts.port   # raises on a port that is not one
    except ValueError:
        _bad("EngineConfig", "otlp_traces_endpoint", url, rule)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        _bad("EngineConfig", "otlp_traces_endpoint", url, rule)


class ConfigError(ValueError):
    """A value a config refuses, naming the config and the field (how check_option_flags finds the flag to name)."""

    def __init__(self, config: str, field: str, message: str):
        super().__init__(message)
        self.config, self.field = config, field


def _bad(cls: str, field: str, value, rule: str):
    raise ConfigError(cls, field, f"{cls}.{field}={value!r}: {rule}")


def _positive_int(cls, field, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _bad(cls, field, value, "must be an integer >= 1")


class ModelConfig(msgspec.Struct, kw_only=True):
    """Which weights, in what dtype, and the longest sequence (prompt + output) a request may reach."""

    model: Annotated[str, Option("tiny-llama, smollm2, a Hugging Face directory or a .gguf file",
                                 metavar="M")] = "tiny-llama"
    dtype: Annotated[str, Option("the dtype of weights and activations", choices=DTYPES)] = "float32"
    max_model_len: Annotated[int | None, Option("the longest sequence (prompt + output) a request may reach "
                                                "(default: the model's)")] = None
    seed: Annotated[int, Option("seeds the weights of built-in models and sampling without a seed of its own",
                                metavar="S")] = 0
    device: Annotated[str, Option("cpu, cuda (each rank its own GPU, nccl between them) or cuda:N "
                                  "(one worker on GPU N)", metavar="D")] = "cpu"
    kernels: Annotated[str, Option(
        "the kernel backend every op runs: fast (on the CPU C kernels built with the machine's compiler on first "
        "use; reference, with a warning, where they cannot build) or reference (plain torch); debug mode runs "
        "the same", choices=KERNEL_BACKENDS)] = "fast"
    batch_invariant: Annotated[bool, Option(
        "a row's numbers do not depend on what else is in the batch: every op with a custom kernel runs it at every "
        "row count, whatever `bench kernels --save` chose (the library forms it may choose above N rows sum in "
        "an order that depends on the rows); the fast kernels on the CPU, float32")] = False
    dequantize: Annotated[bool, Option(
        "load a GGUF file's Q4_1 and Q8_0 weights as float (dtype) matrices; by default they stay in the file's "
        "blocks and the quantized ops multiply by them (on the CPU in float32 where the fast kernels build)")] = False

    def __post_init__(self):
        if self.kernels not in KERNEL_BACKENDS:
            _bad("ModelConfig", "kernels", self.kernels, f"must be one of {', '.join(KERNEL_BACKENDS)}")
        if not isinstance(self.batch_invariant, bool):
            _bad("ModelConfig", "batch_invariant", self.batch_invariant, "must be True or False")
        if not isinstance(self.dequantize, bool):
            _bad("ModelConfig", "dequantize", self.dequantize, "must be True or False")
        if self.batch_invariant and (self.kernels != "fast" or self.device != "cpu" or self.dtype != "float32"):
            _bad("ModelConfig", "batch_invariant", True, f"needs the fast kernels on the CPU in float32 (here "
                 f"kernels={self.kernels}, device={self.device}, dtype={self.dtype}: else torch's library kernels "
                 "run, whose sums over a row may depend on the rows beside it)")
        if not isinstance(self.model, str) or not self.model:
            _bad("ModelConfig", "model", self.model, "give a built-in name (tiny-llama, smollm2), "
                 "a Hugging Face directory or a .gguf file")
        if self.dtype not in DTYPES:
            _bad("ModelConfig", "dtype", self.dtype, f"must be one of {', '.join(DTYPES)}")
        if self.max_model_len is not None:
            _positive_int("ModelConfig", "max_model_len", self.max_model_len)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            _bad("ModelConfig", "seed", self.seed, "must be an integer in [0, 2**63)")
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            _bad("ModelConfig", "device", self.device, "must be cpu, cuda or cuda:N")


class ParallelConfig(msgspec.Struct, kw_only=True):
    """The tp x pp grid and the backend that runs its workers."""

    tensor_parallel_size: Annotated[int, Option("tensor parallel size", flag="--tp")] = 1
    pipeline_parallel_size: Annotated[int, Option("pipeline parallel size", flag="--pp")] = 1
    distributed_executor_backend: Annotated[str | None, Option(
        "uni (in process), mp (processes) or ray (actors); default uni at tp=pp=1, else mp", flag="--executor",
        choices=EXECUTOR_BACKENDS)] = None
    ray_address: Annotated[str | None, Option(
        "join this Ray cluster, shipping the devharness package with the job (default: $RAY_ADDRESS, else a "
        "private local Ray instance)", metavar="ADDR")] = None
    ray_control_plane: Annotated[str, Option(
        "how the Ray executor sends each step to its actors: shm (a shared-memory ring) or cgraph (a Ray "
        "Compiled Graph)", choices=RAY_CONTROL_PLANES)] = "shm"
    placement_strategy: Annotated[str, Option("the Ray placement group's strategy for the workers",
                                              choices=PLACEMENT_STRATEGIES)] = "PACK"
    threads_per_worker: Annotated[int | None, Option(
        "torch threads in each worker (default: the node's cores shared among its workers)", metavar="N")] = None
    step_timeout_s: Annotated[float, Option(
        "a rank that never arrives becomes an error after this long (outside debug mode)", flag="--step-timeout",
        metavar="S")] = 120.0
    hang_after_s: Annotated[float, Option(
        "report a rank waiting this long in a collective for a peer not in it (0: never)", flag="--hang-after",
        metavar="S")] = 5.0
    async_collectives: Annotated[bool | None, Option(
        "issue the collectives asynchronously (async_op=True) and wait where the result is used, as on CUDA: the "
        "host thread moves on while its collective waits (default: on with CUDA, off on the CPU)",
        flag="--async-collectives")] = None
    max_concurrent_batches: Annotated[int | None, Option(
        "batches of disjoint requests in flight at once: with pp=N, stage k runs batch i while stage k+1 runs "
        "batch i-1 (default: the pp size; 1: one at a time)", metavar="N")] = None
    restart_workers: Annotated[bool, Option(
        "when a worker dies, end its requests with an error, stop the other workers and start a fresh set (same "
        "ranks, same debug ports); meanwhile new requests get 503 with Retry-After", group="restart")] = False
    max_worker_restarts: Annotated[int, Option(
        "with --restart-workers: after N restarts in a row with no step completed between them, stop restarting "
        "and stay dead (503 naming the cause)", group="restart", metavar="N")] = 3
    pp_layer_partition: Annotated[list[int] | None, Option(
        "layers per pipeline stage, first to last (default: the split that evens out the stages' matrix products, "
        "the last stage's LM head counted: smollm2 at pp=2 gets 17,13)", metavar="N,N,...",
        parse=_layer_counts)] = None

    def __post_init__(self):
        _positive_int("ParallelConfig", "tensor_parallel_size", self.tensor_parallel_size)
        _positive_int("ParallelConfig", "pipeline_parallel_size", self.pipeline_parallel_size)
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            _bad("ParallelConfig", "distributed_executor_backend", self.distributed_executor_backend,
                 f"must be one of {', '.join(EXECUTOR_BACKENDS)}")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            _bad("ParallelConfig", "distributed_executor_backend", "uni",
                 f"runs one worker in this process; tp x pp = {self.world_size} needs 'mp' or 'ray'")
        if self.ray_control_plane not in RAY_CONTROL_PLANES:
            _bad("ParallelConfig", "ray_control_plane", self.ray_control_plane,
                 f"must be one of {', '.join(RAY_CONTROL_PLANES)}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            _bad("ParallelConfig", "placement_strategy", self.placement_strategy,
                 f"must be one of {', '.join(PLACEMENT_STRATEGIES)}")
        if self.threads_per_worker is not None:
            _positive_int("ParallelConfig", "threads_per_worker", self.threads_per_worker)
        if not self.step_timeout_s > 0:
            _bad("ParallelConfig", "step_timeout_s", self.step_timeout_s, "must be > 0 seconds")
        if not self.hang_after_s >= 0:
            _bad("ParallelConfig", "hang_after_s", self.hang_after_s, "must be >= 0 seconds (0: never)")
        if self.async_collectives is not None and not isinstance(self.async_collectives, bool):
            _bad("ParallelConfig", "async_collectives", self.async_collectives, "must be True, False or None")
        if self.max_concurrent_batches is not None:
            _positive_int("ParallelConfig", "max_concurrent_batches", self.max_concurrent_batches)
        if not isinstance(self.restart_workers, bool):
            _bad("ParallelConfig", "restart_workers", self.restart_workers, "must be True or False")
        if isinstance(self.max_worker_restarts, bool) or not isinstance(self.max_worker_restarts, int) \
                or self.max_worker_restarts < 1:
            _bad("ParallelConfig", "max_worker_restarts", self.max_worker_restarts, "must be an integer >= 1")
        if self.pp_layer_partition is not None:
            parts = self.pp_layer_partition
            if not isinstance(parts, list) or len(parts) != self.pipeline_parallel_size or any(
                    isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in parts):
                _bad("ParallelConfig", "pp_layer_partition", parts,
                     f"must be {self.pipeline_parallel_size} layer counts >= 1, one per pipeline stage")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def batches_in_flight(self) -> int:
        """max_concurrent_batches, its default resolved (the pp size)."""
        return self.max_concurrent_batches or self.pipeline_parallel_size


# The stall detector's limits (engine/request_story.py): K steps passed over, T seconds idle, P preemptions.
STALL_STEPS, STALL_IDLE_S, STALL_PREEMPTIONS = 32, 30.0, 8


class SchedulerConfig(msgspec.Struct, kw_only=True):
    """Batch limits and the paged KV cache's size."""

    max_num_seqs: Annotated[int, Option("requests a step may hold at most")] = 64
    max_num_batched_tokens: Annotated[int, Option(
        "tokens a step computes at most, prompt chunks and decodes together (with batches in flight: shared "
        "among them)", metavar="N")] = 1024
    block_size: Annotated[int, Option("tokens per KV cache block", metavar="N")] = 16
    kv_cache_memory_bytes: Annotated[int, Option("each worker's KV cache, in bytes (unless --num-kv-blocks)",
                                                 metavar="BYTES")] = 512 * 1024 * 1024
    num_kv_blocks: Annotated[int | None, Option("exactly this many KV cache blocks per worker (small: forces "
                                                "preemption)", metavar="N")] = None
    enable_prefix_caching: Annotated[bool, Option("reuse the KV blocks of a prompt prefix seen before")] = True
    kv_sanitizer: Annotated[bool | None, Option(
        "check the KV cache every step: no block freed while a table holds it, no leak, reference counts that add "
        "up; a violation fails the step naming request, block and step; and what full blocks hold (checksums per "
        "layer, checked at prefix hits and at reads): a mismatch ends the requests reading the block (default: on in "
        "debug mode)")] = None
    stall_steps: Annotated[int, Option("a waiting request that fits yet is passed over this many steps in a row is "
                                       "reported as a stall", metavar="K")] = STALL_STEPS
    stall_idle_s: Annotated[float, Option("requests waiting with nothing running this many seconds, the engine not "
                                          "paused, are reported as a stall", metavar="T")] = STALL_IDLE_S
    stall_preemptions: Annotated[int, Option("a request preempted more than this many times is reported as a stall",
                                             metavar="P")] = STALL_PREEMPTIONS
    request_stories: Annotated[bool, Option(
        "keep each request's story: its waiting reasons, the stall detector, GET /debug/requests, /metrics' waiting "
        "requests by reason, the OTLP spans (off: none of them; a request's queue time is then its first wait "
        "only)")] = True

    def __post_init__(self):
        for f in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory_bytes", "stall_steps",
                  "stall_preemptions"):
            _positive_int("SchedulerConfig", f, getattr(self, f))
        if self.num_kv_blocks is not None:
            _positive_int("SchedulerConfig", "num_kv_blocks", self.num_kv_blocks)
        if isinstance(self.stall_idle_s, bool) or not isinstance(self.stall_idle_s, (int, float)) \
                or not 0 < self.stall_idle_s < float("inf"):
            _bad("SchedulerConfig", "stall_idle_s", self.stall_idle_s, "must be a number of seconds > 0")
        if not isinstance(self.request_stories, bool):
            _bad("SchedulerConfig", "request_stories", self.request_stories, "must be True or False")
        if self.kv_sanitizer is not None and not isinstance(self.kv_sanitizer, bool):
            _bad("SchedulerConfig", "kv_sanitizer", self.kv_sanitizer, "must be True, False or None (on in debug mode)")


class DebugConfig(msgspec.Struct, kw_only=True):
    """Debug mode: a debugpy listener per worker on host:(port_base + rank), long collective timeouts."""

    enabled: Annotated[bool, Option("debugpy in every worker, /debug routes, long timeouts", flag="--debug",
                                    group="debug")] = False
    host: Annotated[str, Option("where debug listeners bind; anything but loopback lets others run code in the "
                                "workers", flag="--debug-host", group="debug", metavar="H")] = "127.0.0.1"
    port_base: Annotated[int, Option("rank r listens for debugpy on P + r", flag="--debug-port-base",
                                     group="debug", metavar="P")] = DEBUG_PORT_BASE
    wait_ranks: Annotated[list[int], Option("comma-separated ranks that wait for a debugger before their first "
                                            "step", flag="--debug-wait", group="debug", metavar="RANKS",
                                            parse=_ranks)] = []
    timeout_s: Annotated[float, Option("in debug mode, how long collectives and step waits wait (a human may "
                                       "sit at a breakpoint)", flag="--debug-timeout", group="debug",
                                       metavar="S")] = 3600.0
    post_mortem: Annotated[bool, Option("in debug mode, a worker exception pauses its rank for a debugger",
                                        flag="--debug-post-mortem", group="debug")] = True

    def __post_init__(self):
        if isinstance(self.port_base, bool) or not isinstance(self.port_base, int) or not 1 <= self.port_base <= 65535:
            _bad("DebugConfig", "port_base", self.port_base, "must be a TCP port in 1..65535")
        if not self.timeout_s > 0:
            _bad("DebugConfig", "timeout_s", self.timeout_s, "must be > 0 seconds")

    @property
    def host_is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


class EngineConfig(msgspec.Struct, kw_only=True):
    run_id: Annotated[str, Option("names this engine's shared-memory files and actors; filled in by the engine",
                                  internal=True)] = ""
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    debug: DebugConfig = msgspec.field(default_factory=DebugConfig)
    record_dir: Annotated[str | None, Option(
        "write every step (step message, sampled tokens) here, for `devharness replay DIR`", flag="--record",
        group="record", metavar="DIR")] = None
    inject: Annotated[str | None, Option(
        "plant a known bug, e.g. allreduce-drop:layer=1:rank=1 or raise:step=5:rank=0 (none: no bug)",
        metavar="SPEC")] = None
    numerics_check: Annotated[bool | None, Option(
        "every rank checks its rows are finite after each layer's sites and the logits; the first nan or inf is named "
        "(step, rank, layer, site, request, token position) where it was born, and only the requests that hold it "
        "end (default: off, in debug mode too: it costs more than 3 percent of a step, docs/benchmarks.md)")] = None
    flight_steps: Annotated[int, Option("the flight recorder keeps the last K steps for a bundle (0: off)",
                                        metavar="K")] = 64
    bundle_dir: Annotated[str | None, Option(
        "where bundles go (on a worker error, a hang, a stall, or asked for); default <tempdir>/devharness-bundles",
        metavar="DIR")] = None
    profiler_dir: Annotated[str | None, Option(
        "where a torch profile (start_profile; serve: POST /start_profile, offered with this or --debug) writes its "
        "Chrome traces, one per rank; default <tempdir>/devharness-profiles", metavar="DIR")] = None
    otlp_traces_endpoint: Annotated[str | None, Option(
        "send each ended request's story as OpenTelemetry spans (the request, its time queued, prefill, decode) "
        "over OTLP/HTTP (protobuf) to this URL, e.g. http://127.0.0.1:4318/v1/traces (a URL with no path gets "
        "/v1/traces); nothing is sent without it", metavar="URL")] = None
    digest_logits: Annotated[bool, Option("the output rank returns each sampled row's logits digest (replay "
                                          "sets it)", internal=True)] = False

    def __post_init__(self):
        if self.scheduler.kv_sanitizer is None:   # on in debug mode unless told otherwise
            self.scheduler.kv_sanitizer = self.debug.enabled
        # Off unless asked, in debug mode too: `bench debug-overhead --part numerics` measured more than the 3% of a
        # step that would make it a debug-mode default (docs/benchmarks.md).
        if self.numerics_check is None:
            self.numerics_check = False
        elif not isinstance(self.numerics_check, bool):
            _bad("EngineConfig", "numerics_check", self.numerics_check, "must be True, False or None (off)")
        if self.inject == "none":
            self.inject = None
        if self.inject is not None:   # its words here; whether its rank and layer exist, once the model is known
            try:
                parse_fault_spec(self.inject, what=f"EngineConfig.inject={self.inject!r}")
            except ValueError as e:
                raise ConfigError("EngineConfig", "inject", str(e)) from None
        if self.otlp_traces_endpoint is not None:
            _check_otlp_url(self.otlp_traces_endpoint)
            if not self.scheduler.request_stories:
                _bad("EngineConfig", "otlp_traces_endpoint", self.otlp_traces_endpoint,
                     "the spans are the requests' stories: it needs SchedulerConfig.request_stories on")
        if isinstance(self.flight_steps, bool) or not isinstance(self.flight_steps, int) or self.flight_steps < 0:
            _bad("EngineConfig", "flight_steps", self.flight_steps, "must be an integer >= 0 (0: no flight recorder)")
        if ":" in self.model.device and self.parallel.world_size > 1:
            _bad("ModelConfig", "device", self.model.device, f"names one GPU, but tp x pp = {self.parallel.world_size} "
                 "ranks each need their own: give 'cuda' (rank r takes GPU r modulo the GPUs it sees)")
