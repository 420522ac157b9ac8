"""Engine configuration. Each config checks its own fields and raises ValueError naming field, value and fix."""
from __future__ import annotations

import ipaddress
import re

import msgspec

EXECUTOR_BACKENDS = ("uni", "mp", "ray")
RAY_CONTROL_PLANES = ("shm", "cgraph")
DTYPES = ("float32", "bfloat16", "float16")
# The kernel backends (devharness/kernels): every op's plain-torch reference, or the fast kernels (the default).
KERNEL_BACKENDS = ("reference", "fast")


def _bad(cls: str, field: str, value, rule: str):
    raise ValueError(f"{cls}.{field}={value!r}: {rule}")


def _positive_int(cls, field, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _bad(cls, field, value, "must be an integer >= 1")


class ModelConfig(msgspec.Struct, kw_only=True):
    """Which weights, in what dtype, and the longest sequence (prompt + output) a request may reach."""

    model: str = "tiny-llama"
    dtype: str = "float32"
    max_model_len: int | None = None
    seed: int = 0
    # Where every tensor of the model, its inputs, its KV cache and its sampler lives: cpu, cuda (each rank
    # its own GPU) or cuda:N (one worker on GPU N).
    device: str = "cpu"
    # The kernels every op of the model runs (devharness/kernels): "fast" (on the CPU the C kernels, built on
    # first use, where they take the tensors; "reference" with one warning where they cannot be built) or
    # "reference" (plain torch). Debug mode runs the same ones.
    kernels: str = "fast"

    def __post_init__(self):
        if self.kernels not in KERNEL_BACKENDS:
            _bad("ModelConfig", "kernels", self.kernels, f"must be one of {', '.join(KERNEL_BACKENDS)}")
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

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    ray_address: str | None = None
    ray_control_plane: str = "shm"
    placement_strategy: str = "PACK"
    threads_per_worker: int | None = None
    # A hang (a rank that never arrives) becomes an error after this long outside debug mode.
    step_timeout_s: float = 120.0
    # A rank waiting this long in a collective for a peer that is not in it is reported (monitor/hang.py);
    # 0: never.
    hang_after_s: float = 5.0
    # Batches of disjoint requests in flight at once (vLLM's batch queue): with pp=N, stage k runs batch i
    # while stage k+1 runs batch i-1. None: the pp size; 1: one batch at a time.
    max_concurrent_batches: int | None = None
    # After a worker dies (or a step fails and leaves the workers unusable), stop the survivors and start a
    # fresh set (the same ranks, debug ports and model) instead of leaving the engine dead.
    restart_workers: bool = False
    # A crash loop ends: after this many restarts in a row with no step completed between them, the engine
    # stays dead (naming the cause) instead of starting workers that die again.
    max_worker_restarts: int = 3
    # Layers per pipeline stage, first to last (its sum: the model's layers); None: as even as can be. The
    # last stage also runs the LM head, which at decode costs several layers' worth: giving it fewer layers
    # balances the stages when batches are in flight.
    pp_layer_partition: list[int] | None = None

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
        if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            _bad("ParallelConfig", "placement_strategy", self.placement_strategy,
                 "must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD")
        if self.threads_per_worker is not None:
            _positive_int("ParallelConfig", "threads_per_worker", self.threads_per_worker)
        if not self.step_timeout_s > 0:
            _bad("ParallelConfig", "step_timeout_s", self.step_timeout_s, "must be > 0 seconds")
        if not self.hang_after_s >= 0:
            _bad("ParallelConfig", "hang_after_s", self.hang_after_s, "must be >= 0 seconds (0: never)")
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


class SchedulerConfig(msgspec.Struct, kw_only=True):
    """Batch limits and the paged KV cache's size."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    # KV cache per worker: a byte budget, or an exact block count (tests force preemption with it).
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self):
        for f in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory_bytes"):
            _positive_int("SchedulerConfig", f, getattr(self, f))
        if self.num_kv_blocks is not None:
            _positive_int("SchedulerConfig", "num_kv_blocks", self.num_kv_blocks)


class DebugConfig(msgspec.Struct, kw_only=True):
    """Debug mode: a debugpy listener per worker on host:(port_base + rank), long collective timeouts."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port_base: int = 5678
    wait_ranks: list[int] = []
    # In debug mode a human may sit at a breakpoint: collectives and step waits get this long.
    timeout_s: float = 3600.0
    post_mortem: bool = True

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
    # Names this engine's shared-memory files and actors; filled in by the engine when empty.
    run_id: str = ""
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    debug: DebugConfig = msgspec.field(default_factory=DebugConfig)
    record_dir: str | None = None   # the driver writes every step here (engine/record.py)
    inject: str | None = None       # a planted bug, `--inject SPEC` (debug/faults.py)
    flight_steps: int = 64          # steps the flight recorder keeps for a bundle (engine/record.py); 0: none
    bundle_dir: str | None = None   # where bundles go (monitor/bundle.py); default <tempdir>/devharness-bundles
    digest_logits: bool = False     # the output rank returns each sampled row's logits digest (replay sets it)

    def __post_init__(self):
        if isinstance(self.flight_steps, bool) or not isinstance(self.flight_steps, int) or self.flight_steps < 0:
            _bad("EngineConfig", "flight_steps", self.flight_steps, "must be an integer >= 0 (0: no flight recorder)")
        if ":" in self.model.device and self.parallel.world_size > 1:
            _bad("ModelConfig", "device", self.model.device, f"names one GPU, but tp x pp = {self.parallel.world_size} "
                 "ranks each need their own: give 'cuda' (rank r takes GPU r modulo the GPUs it sees)")
