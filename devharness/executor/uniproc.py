"""The reference executor: one worker, in this process, called directly."""
from __future__ import annotations

from devharness.executor.base import Executor, StepFuture
from devharness.protocol.frames import control_decoder, encode
from devharness.protocol.messages import SchedulerOutput
from devharness.worker.device import check_available
from devharness.worker.worker import Worker


class UniProcExecutor(Executor):
    """The one worker (tp = pp = 1) in this process, called directly."""

    def _init_workers(self) -> None:
        check_available(self.config.model.device, 1)
        self.worker = Worker(self.config, self.source, rank=0, max_model_len=self.max_model_len, own_process=False)
        try:
            self.worker.init_device()
            self.worker.load_model()
        except BaseException:   # a load that fails leaves no state file or process group behind
            self.worker.shutdown()
            raise

    def execute_model_async(self, so: SchedulerOutput) -> StepFuture:
        return StepFuture.done(so.step, self.worker.execute_model(so))

    def model_in_process(self):
        return self.worker.runner.model

    def _control(self, call, ranks, timeout_s, what):
        # Through msgpack as on the other backends: the same reply types, no shared objects.
        return [encode(self.worker.control(control_decoder.decode(call)))]

    def shutdown(self, force: bool = False) -> None:
        self.worker.shutdown()
