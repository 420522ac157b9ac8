"""The reference executor: one worker, in this process, called directly."""
from __future__ import annotations

from devharness.executor.base import Executor
from devharness.messages import ModelRunnerOutput, SchedulerOutput
from devharness.worker.worker import Worker


class UniProcExecutor(Executor):
    supports_pp = False

    def _init_workers(self) -> None:
        self.worker = Worker(self.config, self.source, rank=0, max_model_len=self.max_model_len)
        try:
            self.worker.init_device()
            self.worker.load_model()
        except BaseException:   # a load that fails leaves no state file or process group behind
            self.worker.shutdown()
            raise

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(so)

    def collective_rpc(self, method, args=(), ranks=None, timeout_s=None):
        self._check_method(method)
        return [getattr(self.worker, method)(*args)]

    def shutdown(self, force: bool = False) -> None:
        self.worker.shutdown()
