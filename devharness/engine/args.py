"""EngineArgs: every argument an engine takes, in one place, with the CLI's flags beside them.

`LLM(...)`, `AsyncLLM.from_engine_args`, `devharness serve|generate|check` and every bench build their
engine from it: `EngineArgs.add_cli_args(parser)` declares the flags, `EngineArgs.from_cli_args(ns)`
reads them back, `create_engine_config()` checks and groups them (each config raises ValueError naming
the field). The CLI only dispatches; nothing imports it.
"""
from __future__ import annotations

import argparse
import dataclasses

from devharness.config import (EXECUTOR_BACKENDS, KERNEL_BACKENDS, RAY_CONTROL_PLANES, DebugConfig, EngineConfig,
                               ModelConfig, ParallelConfig, SchedulerConfig)


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


@dataclasses.dataclass
class EngineArgs:
    """Keyword arguments of `LLM(...)` (vLLM's names); `debug` is a bool or a whole DebugConfig."""

    model: str = "tiny-llama"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    ray_address: str | None = None
    ray_control_plane: str = "shm"
    placement_strategy: str = "PACK"
    threads_per_worker: int | None = None
    step_timeout_s: float = 120.0
    hang_after_s: float = 5.0
    max_concurrent_batches: int | None = None   # batches in flight; None: the pp size
    restart_workers: bool = False   # a dead worker: start a fresh set of workers instead of a dead engine
    max_worker_restarts: int = 3    # restarts in a row without a completed step before the engine stays dead
    pp_layer_partition: list[int] | None = None   # layers per pipeline stage (None: balanced, the LM head counted)
    seed: int = 0
    dtype: str = "float32"
    max_model_len: int | None = None
    device: str = "cpu"
    kernels: str = "fast"           # the kernel backend: fast or reference (devharness/kernels); debug mode alike
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    debug: bool | DebugConfig = False
    record_dir: str | None = None   # write every step here, for `devharness replay` (engine/record.py)
    inject: str | None = None       # plant a known bug: debug/faults.py
    flight_steps: int = 64          # steps the flight recorder keeps for bundles (0: none)
    bundle_dir: str | None = None   # where bundles are written (default <tempdir>/devharness-bundles)

    def create_engine_config(self) -> EngineConfig:
        debug = self.debug if isinstance(self.debug, DebugConfig) else DebugConfig(enabled=bool(self.debug))
        return EngineConfig(
            model=ModelConfig(model=self.model, dtype=self.dtype, max_model_len=self.max_model_len, seed=self.seed,
                              device=self.device, kernels=self.kernels),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                    pipeline_parallel_size=self.pipeline_parallel_size,
                                    distributed_executor_backend=self.distributed_executor_backend,
                                    ray_address=self.ray_address, ray_control_plane=self.ray_control_plane,
                                    placement_strategy=self.placement_strategy,
                                    threads_per_worker=self.threads_per_worker, step_timeout_s=self.step_timeout_s,
                                    hang_after_s=self.hang_after_s,
                                    max_concurrent_batches=self.max_concurrent_batches,
                                    pp_layer_partition=self.pp_layer_partition,
                                    restart_workers=self.restart_workers,
                                    max_worker_restarts=self.max_worker_restarts),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                      block_size=self.block_size, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                                      num_kv_blocks=self.num_kv_blocks,
                                      enable_prefix_caching=self.enable_prefix_caching),
            debug=debug, record_dir=self.record_dir, inject=self.inject, flight_steps=self.flight_steps,
            bundle_dir=self.bundle_dir)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        """`LLM(...)`'s keyword arguments; an unknown one is a ValueError naming it and the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)

    # -- the command line ------------------------------------------------------------------------

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, debug: bool = False, record: bool = False,
                     restart: bool = False) -> argparse.ArgumentParser:
        p = parser
        p.add_argument("--model", default="tiny-llama",
                       help="tiny-llama, smollm2, a Hugging Face directory or a .gguf file")
        p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
        p.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
        p.add_argument("--executor", choices=EXECUTOR_BACKENDS, default=None,
                       help="uni (in process), mp (processes) or ray (actors); default uni at tp=pp=1, else mp")
        p.add_argument("--max-concurrent-batches", type=int, default=None, metavar="N",
                       help="batches of disjoint requests in flight at once (default: the pp size; 1: one at a time)")
        p.add_argument("--pp-layer-partition", type=_layer_counts, default=None, metavar="N,N,...",
                       help="layers per pipeline stage, first to last (default: the split that evens out the stages' "
                            "matrix products, the last stage's LM head counted: smollm2 at pp=2 gets 17,13)")
        p.add_argument("--ray-control-plane", choices=RAY_CONTROL_PLANES, default="shm")
        p.add_argument("--ray-address", default=None,
                       help="join this Ray cluster, shipping the devharness package with the job "
                            "(default: $RAY_ADDRESS, else a private local Ray instance)")
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--max-num-seqs", type=int, default=64)
        p.add_argument("--max-num-batched-tokens", type=int, default=1024, metavar="N",
                       help="tokens a step computes at most, prompt chunks and decodes together (with batches in "
                            "flight: shared among them)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--device", default="cpu",
                       help="cpu, cuda (each rank its own GPU, nccl between them) or cuda:N (one worker on GPU N)")
        p.add_argument("--kernels", choices=KERNEL_BACKENDS, default="fast",
                       help="the kernel backend every op runs: fast (on the CPU C kernels built with the machine's "
                            "compiler on first use; reference, with a warning, where they cannot build) or "
                            "reference (plain torch); debug mode runs the same")
        p.add_argument("--hang-after", type=float, default=5.0, metavar="S",
                       help="report a rank waiting this long in a collective for a peer not in it (0: never)")
        p.add_argument("--inject", metavar="SPEC", default=None,
                       help="plant a known bug, e.g. allreduce-drop:layer=1:rank=1 or raise:step=5:rank=0")
        p.add_argument("--flight-steps", type=int, default=64, metavar="K",
                       help="the flight recorder keeps the last K steps for a bundle (0: off)")
        p.add_argument("--bundle-dir", default=None, metavar="DIR",
                       help="where bundles go (on a worker error, a hang, or asked for); default "
                            "<tempdir>/devharness-bundles")
        if record:
            p.add_argument("--record", metavar="DIR", default=None,
                           help="write every step (step message, sampled tokens) here, for `devharness replay DIR`")
        if restart:
            p.add_argument("--restart-workers", action="store_true",
                           help="when a worker dies, end its requests with an error, stop the other workers and "
                                "start a fresh set (same ranks, same debug ports); meanwhile new requests get "
                                "503 with Retry-After")
            p.add_argument("--max-worker-restarts", type=int, default=3, metavar="N",
                           help="with --restart-workers: after N restarts in a row with no step completed between "
                                "them, stop restarting and stay dead (503 naming the cause)")
        if debug:
            p.add_argument("--debug", action="store_true", help="debugpy in every worker, /debug routes, long timeouts")
            p.add_argument("--debug-host", default="127.0.0.1",
                           help="where debug listeners bind; anything but loopback lets others run code in the workers")
            p.add_argument("--debug-port-base", type=int, default=5678, help="rank r listens on base + r")
            p.add_argument("--debug-wait", type=_ranks, default=[], metavar="RANKS",
                           help="comma-separated ranks that wait for a debugger before their first step")
        return p

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        debug: bool | DebugConfig = False
        if getattr(ns, "debug", False):
            debug = DebugConfig(enabled=True, host=ns.debug_host, port_base=ns.debug_port_base,
                                wait_ranks=ns.debug_wait)
        return cls(model=ns.model, tensor_parallel_size=ns.tp, pipeline_parallel_size=ns.pp,
                   distributed_executor_backend=ns.executor, dtype=ns.dtype, max_model_len=ns.max_model_len,
                   seed=ns.seed, device=ns.device, kernels=ns.kernels,
                   max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
                   ray_control_plane=ns.ray_control_plane, ray_address=ns.ray_address, debug=debug,
                   record_dir=getattr(ns, "record", None), inject=ns.inject, hang_after_s=ns.hang_after,
                   flight_steps=ns.flight_steps, bundle_dir=ns.bundle_dir,
                   max_concurrent_batches=ns.max_concurrent_batches, pp_layer_partition=ns.pp_layer_partition,
                   restart_workers=getattr(ns, "restart_workers", False),
                   max_worker_restarts=getattr(ns, "max_worker_restarts", 3))

    def kwargs(self) -> dict:
        """As `LLM(**engine_args.kwargs())` takes them (a shallow copy: DebugConfig stays one)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
