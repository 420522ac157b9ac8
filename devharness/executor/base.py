"""Executor: starts the workers of a tp x pp grid and runs each engine step on all of them."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, ClassVar


from devharness.config import EngineConfig
from devharness.debug.state import remove_run_files
from devharness.protocol.messages import CONTROL_CALLS, ControlCall, ModelRunnerOutput, Ping, SchedulerOutput
from devharness.model.loader import ModelSource
from devharness.protocol.errors import WorkerDied, WorkerError  # noqa: F401 (what every executor raises)
from devharness.protocol.frames import encode, reply_value_decoder



class StepFuture:
    """A step sent to the workers; `result()` waits for its output (and raises what the step raised). An
    executor's futures resolve in the order they were made: every pipeline stage runs steps in that order."""

    __slots__ = ("step", "_collect", "_output")

    def __init__(self, step: int, collect: Callable[[], ModelRunnerOutput]):
        self.step, self._collect, self._output = step, collect, None

    @classmethod
    def done(cls, step: int, output: ModelRunnerOutput) -> "StepFuture":
        future = cls(step, None)
        future._output = output
        return future

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._collect()
        return self._output


def with_kv_alarms(out: ModelRunnerOutput, others: list, decode) -> ModelRunnerOutput:
    """The output rank's step output, with the KV checksum alarms the other ranks returned (a rank that produces no
    tokens returns an output only to report them: debug/kv_checksums.py), all in rank order."""
    alarms = list(out.kv_alarms)
    for data in others:
        if data is not None and bytes(data) != b"\xc0":   # msgpack nil: the rank had nothing to report
            alarms += decode(data).kv_alarms
    if alarms:
        out.kv_alarms = sorted(alarms, key=lambda a: a.rank)
    return out


class Executor(ABC):
    """One interface for uni, mp and ray. Backends are imported only when chosen."""

    uses_ray: ClassVar[bool] = False

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

    @property
    def supports_async_steps(self) -> bool:
        """Whether execute_model_async returns before the step ran, so that several steps (batches of
        disjoint requests) can be in flight; where not, it runs the step first."""
        return False

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the output rank's sampled tokens."""
        return self.execute_model_async(so).result()

    @abstractmethod
    def execute_model_async(self, so: SchedulerOutput) -> StepFuture:
        """Send one step to every worker; its future. The caller resolves futures in the order it made them."""

    def control(self, call: ControlCall, ranks: list[int] | None = None, timeout_s: float | None = None) -> list:
        """Send a control call (messages.py) to the given ranks (all by default); their replies, each a
        `call.Reply`, in rank order, the same types on every backend. `timeout_s` defaults to the step
        timeout (the debug timeout in debug mode). A call that raises on some rank raises WorkerError
        naming each such rank."""
        if not isinstance(call, CONTROL_CALLS):
            raise ValueError(f"{call!r} is not a control call (one of "
                             f"{', '.join(c.__name__ for c in CONTROL_CALLS)})")
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        if bad := [r for r in ranks if not 0 <= r < self.world_size]:
            raise ValueError(f"{type(call).__name__}: ranks {bad} are outside 0..{self.world_size - 1}")
        return [reply_value_decoder(type(call)).decode(b)
                for b in self._control(encode(call), ranks, timeout_s, type(call).__name__)]

    @abstractmethod
    def _control(self, call: bytes, ranks: list[int], timeout_s: float | None, what: str) -> list[bytes]:
        """The encoded call to `ranks`; their encoded replies in the same order."""

    def model_in_process(self):
        """The worker's model (a torch.nn.Module), where it runs in this process (the uni executor), for an observer
        in the same process: a forward hook (`register_forward_pre_hook` and the like; remove it after), a look at
        the weights. Calling it or changing it changes what the engine runs. ValueError on executors whose workers
        run in processes of their own (mp, ray): use control calls (`control`) there."""
        raise ValueError(f"the {self.config.parallel.distributed_executor_backend} executor's workers run in processes "
                         "of their own: no model in this process (distributed_executor_backend='uni' has one)")

    def exposure(self) -> str | None:
        """What of this run's own ports other machines can reach, and why, as one line for `serve` to print;
        None when nothing is (every rank on this machine: all of it listens on loopback). The HTTP server and
        the debug listeners follow their own --host and --debug-host."""
        return None

    def check_health(self) -> None:
        """Raise WorkerError if a worker is dead. Must not wait on the workers: a rank that is paused or
        hung in a step is not dead, and a health check that waited for it would hold the engine."""
        self.control(Ping())

    def restart_workers(self) -> None:
        """Stop every worker without waiting on it (the peers of a dead rank sit in a collective) and start a
        fresh set from the same config: the same ranks, debug ports and model. Afterwards init_device and
        load_model have run, as after start-up; the KV cache is the caller's to set up again."""
        self.shutdown(force=True)
        # A new worker must not open the dead one's state file (a reader may still map it): new files.
        remove_run_files(self.config.run_id)
        self._init_workers()

    @abstractmethod
    def shutdown(self, force: bool = False) -> None:
        """Stop every worker and free what they held; safe to call twice. `force`: a step is still
        running (a rank paused or hung), so skip the steps of a graceful exit that wait on the workers."""
