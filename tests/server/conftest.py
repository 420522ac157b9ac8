"""Servers that several modules of tests/server share."""
import contextlib

import pytest

from tests.conftest import RAY_BOUND
from tests.server import serve_in_thread


@pytest.fixture(scope="session")
def shared_ray_server():
    """get() -> (url, AsyncLLM, app) of one tp=2 tiny-llama server on the shared Ray instance, for the modules that
    leave it as they found it (test_hostile_requests.py, test_ray_server.py; marked RAY_SERVER_GROUP, so that one
    test process runs them): its engine and Ray actors start once, not once per module. Call get() from a fixture
    that has `ray_instance`; the server ends before that instance does (own_ray) and starts again if asked after."""
    stack = contextlib.ExitStack()
    held = {}

    def close():
        held.clear()
        stack.close()

    def get():
        if "server" not in held:
            held["server"] = stack.enter_context(
                serve_in_thread("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="ray",
                                threads_per_worker=1, num_kv_blocks=128, seed=0))
            RAY_BOUND.append(close)
        return held["server"]

    yield get
    close()
