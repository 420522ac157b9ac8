"""Ray's own view of a paused worker: while a rank waits at a breakpoint, Ray's state API lists its
worker with a paused thread and our debugpy port (what the Ray Distributed Debugger extension shows)."""
import pytest

import ray
from ray.util.state import list_workers  # noqa: E402

from devharness.debug.breakpoints import BreakpointSpec  # noqa: E402
from devharness.diagnostics.workers import WorkerMonitor  # noqa: E402
from tests.debug.dap_client import release  # noqa: E402
from tests.debug.test_debug_mode import debug_llm, generate_in_thread  # noqa: E402
from tests.helpers import wait_until  # noqa: E402
from tests.conftest import own_ray  # noqa: E402


@pytest.fixture(scope="module")
def ray_with_state_api():
    # The state API lives in the dashboard; it is asked by address (another Ray may run on this machine).
    # Ended afterwards: a dashboard left running costs the modules after this one CPU time.
    own_ray()
    ctx = ray.init(address="local", num_cpus=8, include_dashboard=True, log_to_driver=False)
    global _dashboard
    _dashboard = f"http://{ctx.dashboard_url}"
    yield
    ray.shutdown()


_dashboard = ""


def paused_workers():
    return {(w.pid, w.debugger_port) for w in list_workers(address=_dashboard, detail=True,
                                                           raise_on_missing_output=False)
            if w.num_paused_threads}


def test_ray_lists_the_paused_rank_with_our_debugger_port(ray_with_state_api):
    with debug_llm("ray") as llm:
        hub = WorkerMonitor(llm.engine)
        hub.arm_breakpoint(BreakpointSpec(rank=1, step=2))
        t, result = generate_in_thread(llm)
        wait_until(lambda: hub.worker_state(1).paused, 60, "rank 1 paused")
        rank1 = hub.worker_state(1)
        assert wait_until(lambda: paused_workers(), 30, "Ray to list a paused worker") == \
            {(rank1.pid, llm.config.debug.port_base + 1)}
        release(llm.config.debug.port_base + 1, join=t)
        assert wait_until(lambda: not paused_workers(), 30, "Ray to list no paused worker")
    assert "error" not in result
