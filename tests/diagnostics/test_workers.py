"""WorkerMonitor tells a dead worker on another node from a late one by the executor's error type (WorkerDied), never
by the words of its message."""
import types

import pytest

from devharness.config import EngineConfig, ParallelConfig
from devharness.executor.base import WorkerDied, WorkerError
from devharness.protocol.messages import WorkerState
from devharness.diagnostics.workers import WorkerMonitor


def remote_monitor(error: Exception) -> WorkerMonitor:
    """Rank 1 on another node; asking it for its state raises `error`."""
    def control(call, ranks, timeout_s=None):
        raise error
    cfg = EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2), run_id="monitortest")
    workers = types.SimpleNamespace(uses_ray=False, node_ids=["driver", "other"], control=control)
    monitor = WorkerMonitor(types.SimpleNamespace(config=cfg, workers=workers))
    monitor._driver_node = "driver"   # as a Ray driver finds it
    assert monitor.remote_ranks == {1}
    return monitor


@pytest.mark.parametrize("error, alive", [
    (WorkerDied("get_state: rank 1 (tp 1, pp 0) died during get_state: the actor is gone", rank=1), False),
    # Words alone do not make a death: a late answer whose text says "died" or "dead" leaves the rank alive.
    (WorkerError("get_state: rank(s) [1] did not answer within 2 s (a rank died? dead?)"), True),
])
def test_a_remote_rank_is_dead_only_by_the_error_type(error, alive):
    monitor = remote_monitor(error)
    last = WorkerState(rank=1, tp_rank=1, pp_rank=0, node_ip="10.0.0.2", pid=77, phase="step", detail="", alive=True)
    monitor._last_known[1] = last
    monitor._asked_at.clear()
    st = monitor.worker_state(1)
    assert st.alive is alive
    if alive:
        assert st == last   # the last answer stays shown while one is late
    else:
        assert st.phase == "dead" and st.detail.startswith("no answer over Ray: get_state: rank 1")
    monitor.close()
