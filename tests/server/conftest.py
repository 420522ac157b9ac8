"""The servers of tests/server's modules, by name. A server that several modules start with the same settings is one
server they share (a session-scoped getter: its engine starts once, not once per module), where every test of
theirs leaves it as it found it; the others are a module's own (module scope), kept here so that one look shows
which settings each module's server has, and which could be shared."""
import contextlib
import os
import secrets
import signal
import subprocess
import types

import httpx
import pytest

from devharness.config import DebugConfig
from tests.conftest import RAY_BOUND
from tests.helpers import free_port_base, serve_process
from tests.server import LOAD_CLIENTS, LOAD_KV_BLOCKS, UNI_SERVER, serve_in_thread


class SharedServer:
    """One serve_in_thread server, started by the first get() and ended by close(); a get() after close() starts it
    again. `on_start(close)` runs at each start (the Ray-backed one registers its close in RAY_BOUND)."""

    def __init__(self, on_start=None, **settings):
        self.settings, self.on_start = settings, on_start
        self.stack, self.server = contextlib.ExitStack(), None

    def get(self):
        if self.server is None:
            self.server = self.stack.enter_context(serve_in_thread(**self.settings))
            if self.on_start is not None:
                self.on_start(self.close)
        return self.server

    def close(self):
        self.server = None
        self.stack.close()


# -- shared servers ------------------------------------------------------------------------------------------

RAY_TP2 = SharedServer(model="tiny-llama", tensor_parallel_size=2, distributed_executor_backend="ray",
                       threads_per_worker=1, num_kv_blocks=128, seed=0, on_start=RAY_BOUND.append)
UNI = SharedServer(**UNI_SERVER)


@pytest.fixture(scope="session")
def shared_ray_server():
    """get() -> (url, AsyncLLM, app) of one tp=2 tiny-llama server on the shared Ray instance, for the modules that
    leave it as they found it (test_hostile_requests.py, test_ray_server.py; marked RAY_SERVER_GROUP, so that one
    test process runs them): its engine and Ray actors start once, not once per module. Call get() from a fixture
    that has `ray_instance`; the server ends before that instance does (own_ray) and starts again if asked after."""
    yield RAY_TP2.get
    RAY_TP2.close()


@pytest.fixture(scope="session")
def shared_uni_server():
    """get() -> (url, AsyncLLM, app) of one tiny-llama server on the uni executor (UNI_SERVER's settings), for
    test_bad_input.py and test_openai_api.py, whose tests leave it as they found it (a bad request is followed by a
    good one; a test that pauses the engine resumes it; the metrics they read they read as changes). Their tests
    ask for it through `uni_server`, which puts them in one xdist group (tests/conftest.py, SHARED_SERVER_GROUPS);
    it ends when the test process moves on to a test without it (pytest_runtest_teardown below), or at the end."""
    yield UNI.get
    UNI.close()


@pytest.fixture(scope="module")
def uni_server(shared_uni_server):
    """(url, AsyncLLM, app) of the shared uni server."""
    return shared_uni_server()


@pytest.hookimpl(trylast=True)   # after the test's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    """The shared uni server ends as soon as this process has run the tests that use it (they run one after
    another: tests/conftest.py sorts a group's modules together), not at the end of the run: its engine thread and
    uvicorn would sit idle till then, and its torch thread count (one, while it runs) would hold for every module
    after it."""
    if nextitem is None or "uni_server" not in getattr(nextitem, "fixturenames", ()):
        UNI.close()


# -- servers of one module -----------------------------------------------------------------------------------

# test_schemathesis.py's servers: small, so that any max_tokens a positive request gets past the context check is cheap.
FUZZ_MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def tiny_engine():
    """test_auth.py, test_slow_clients.py: a tiny-llama AsyncLLM (uni, 32 KV blocks) that each module serves with an
    app of its own settings (authentication, body and header timeouts)."""
    from devharness.engine.args import EngineArgs
    from devharness.engine.async_llm import AsyncLLM
    llm = AsyncLLM.from_engine_args(EngineArgs.from_kwargs(model="tiny-llama", distributed_executor_backend="uni",
                                                           num_kv_blocks=32))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def load_server():
    """test_load.py: (url, AsyncLLM) of a tiny-llama server that runs all LOAD_CLIENTS at once, in LOAD_KV_BLOCKS,
    the numerics check on (the clients' workload must raise no alarm)."""
    with serve_in_thread("tiny-llama", threads_per_worker=1, max_num_seqs=LOAD_CLIENTS, num_kv_blocks=LOAD_KV_BLOCKS,
                         seed=0, numerics_check=True) as (url, llm, app):
        yield url, llm


@pytest.fixture(scope="module")
def fuzz_server():
    """test_schemathesis.py: the url of a tiny-llama server (uni) with a short context (FUZZ_MAX_MODEL_LEN)."""
    with serve_in_thread("tiny-llama", max_model_len=FUZZ_MAX_MODEL_LEN, num_kv_blocks=64, threads_per_worker=1,
                         seed=0) as (url, _, _):
        yield url


@pytest.fixture(scope="module")
def fuzz_debug_server(tmp_path_factory):
    """test_schemathesis.py: the url of fuzz_server's settings on mp, in debug mode (one rank)."""
    dbg = DebugConfig(enabled=True, port_base=free_port_base(1))
    with serve_in_thread("tiny-llama", distributed_executor_backend="mp", max_model_len=FUZZ_MAX_MODEL_LEN,
                         num_kv_blocks=64, threads_per_worker=1, seed=0, debug=dbg,
                         bundle_dir=str(tmp_path_factory.mktemp("bundles"))) as (url, _, _):
        yield url


@pytest.fixture(scope="module")
def debug_tp2_server(tmp_path_factory):
    """test_debug_api.py: (url, AsyncLLM) of a tp=2 mp server in debug mode, writing bundles and a record (its tests
    pause and step the engine and break a rank: a server of its own)."""
    dbg = DebugConfig(enabled=True, port_base=free_port_base())
    with serve_in_thread(tensor_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
                         num_kv_blocks=128, debug=dbg, bundle_dir=str(tmp_path_factory.mktemp("bundles")),
                         record_dir=str(tmp_path_factory.mktemp("served") / "rec")) as (url, llm, app):
        yield url, llm


@pytest.fixture(scope="module")
def profile_server(tmp_path_factory):
    """test_profile_routes.py: (url, profiler folder) of a uni server with --profiler-dir."""
    folder = tmp_path_factory.mktemp("profiles") / "traces"
    with serve_in_thread(distributed_executor_backend="uni", num_kv_blocks=32, profiler_dir=str(folder)) as (url, _, _):
        yield url, folder


@pytest.fixture(scope="module", params=["mp", "ray"])
def release_backend(request):
    """test_health_release.py: the executor of release_server and of its `devharness serve` runs (mp, then Ray on
    the shared instance)."""
    if request.param == "ray":
        request.getfixturevalue("ray_instance")
    return request.param


@pytest.fixture(scope="module")
def release_server(release_backend, tmp_path_factory):
    """test_health_release.py: (url, AsyncLLM) of a tp=2 server in debug mode on release_backend (its tests pause,
    release and break ranks, and the last kills one: a server of its own)."""
    dbg = DebugConfig(enabled=True, port_base=free_port_base())
    # step_timeout_s: in debug mode the workers wait an hour for a paused peer, but /health says a step
    # that ran past this is overdue; and before that, once the hang detector names a rank (hang_after_s).
    with serve_in_thread(tensor_parallel_size=2, distributed_executor_backend=release_backend, threads_per_worker=1,
                         num_kv_blocks=128, debug=dbg, step_timeout_s=3.0, hang_after_s=1.0,
                         bundle_dir=str(tmp_path_factory.mktemp("bundles"))) as (url, llm, _):
        yield url, llm


@pytest.fixture(scope="module", params=["mp", "ray"])
def hostile_server(request):
    """test_hostile_requests.py: (url, AsyncLLM) of a tp=2 tiny-llama server on each backend: on mp a server of the
    module's own (its tests plant worker errors), on Ray the one shared_ray_server shares (same settings)."""
    if request.param == "ray":
        request.getfixturevalue("ray_instance")
        url, llm, _ = request.getfixturevalue("shared_ray_server")()
        yield url, llm
        return
    with serve_in_thread("tiny-llama", tensor_parallel_size=2, distributed_executor_backend=request.param,
                         threads_per_worker=1, num_kv_blocks=128, seed=0) as (url, llm, _):
        yield url, llm


@pytest.fixture(scope="module")
def dialect_server(tiny_hf_dir):
    """test_vllm_dialect.py: (httpx client, AsyncLLM) of a server of the tiny model written as a Hugging Face
    checkpoint (uni)."""
    # 16 tokens per step: a long prompt's prefill runs in chunks, and its prompt logprobs come from several.
    with serve_in_thread(str(tiny_hf_dir), num_kv_blocks=256, seed=0, max_num_batched_tokens=16) as (url, llm, _), \
            httpx.Client(base_url=url, timeout=120) as http:
        yield http, llm


@pytest.fixture(scope="module", params=["uni", "mp"])
def secret_server(request, tmp_path_factory):
    """test_secrets.py: a `devharness serve --debug` process (its own: its tests stop it to read all it printed)
    given an API key and a debug token made for this run: on uni both as flags (rank 0 is the server, whose command
    line py-spy prints), on mp (tp=2) the key from $DEVHARNESS_API_KEY. A namespace: proc, lines (its output), url,
    key, token, backend, bundles (its --bundle-dir)."""
    key, token = f"key{secrets.token_hex(16)}", f"tok{secrets.token_hex(16)}"
    bundles = tmp_path_factory.mktemp("bundles")
    args = ["--executor", request.param, "--debug", "--debug-port-base", str(free_port_base(2)), "--debug-token", token,
            "--num-kv-blocks", "64", "--threads-per-worker", "1", "--bundle-dir", str(bundles)]
    with pytest.MonkeyPatch.context() as env:
        if request.param == "uni":
            args += ["--api-key", key]
        else:
            args += ["--tp", "2"]
            env.setenv("DEVHARNESS_API_KEY", key)   # read by the Popen in serve_process, then unset here again
        proc, lines, url = serve_process(*args)
    try:
        yield types.SimpleNamespace(proc=proc, lines=lines, url=url, key=key, token=token, backend=request.param,
                                    bundles=bundles)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
