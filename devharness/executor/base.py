"""Executor: starts the workers of a tp x pp grid and runs each engine step on all of them."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from devharness.config import EngineConfig
from devharness.messages import ModelRunnerOutput, SchedulerOutput
from devharness.model.loader import ModelSource
from devharness.worker.worker_loop import RPC_METHODS


class WorkerError(RuntimeError):
    """A worker died or failed; the message names its rank."""


class Executor(ABC):
    """One interface for uni, mp and ray. Backends are imported only when chosen."""

    uses_ray: ClassVar[bool] = False
    supports_pp: ClassVar[bool] = True

    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int):
        self.config = config
        self.source = source
        self.max_model_len = max_model_len
        self.world_size = config.parallel.world_size
        self._init_workers()

    @staticmethod
    def get_class(backend: str) -> type["Executor"]:
        if backend == "uni":
            from devharness.executor.uniproc import UniProcExecutor
            return UniProcExecutor
        if backend == "mp":
            from devharness.executor.multiproc import MultiprocExecutor
            return MultiprocExecutor
        if backend == "ray":
            from devharness.executor.ray import RayExecutor
            return RayExecutor
        raise ValueError(f"distributed_executor_backend={backend!r}: must be one of uni, mp, ray")

    @abstractmethod
    def _init_workers(self) -> None:
        """Start the workers; afterwards init_device and load_model have run on each."""

    @abstractmethod
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the output rank's sampled tokens."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), ranks: list[int] | None = None,
                       timeout_s: float | None = None) -> list[Any]:
        """Call a Worker method on the given ranks (all by default); results in rank order.
        `timeout_s` defaults to the step timeout (the debug timeout in debug mode)."""

    def check_health(self) -> None:
        """Raise WorkerError if a worker is dead. Must not wait on the workers: a rank that is paused or
        hung in a step is not dead, and a health check that waited for it would hold the engine."""
        self.collective_rpc("ping")

    @abstractmethod
    def shutdown(self, force: bool = False) -> None:
        """Stop every worker and free what they held; safe to call twice. `force`: a step is still
        running (a rank paused or hung), so skip the steps of a graceful exit that wait on the workers."""

    @staticmethod
    def _check_method(method: str) -> None:
        if method not in RPC_METHODS:
            raise ValueError(f"collective_rpc: {method!r} is not a worker method "
                             f"(one of {', '.join(sorted(RPC_METHODS))})")
