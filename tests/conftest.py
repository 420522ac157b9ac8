import os
import re
import sys
from pathlib import Path

import pytest

# One torch thread per test process, and for the engines and servers they start in subprocesses (set before torch
# is imported, so that it and every child take it): `make test` runs two processes on two cores, and torch's
# default of a thread per core then has four threads spin against each other (tests/engine/test_batching.py
# took 25.6 s so, 7.3 s on one thread). Tests that mean a thread count set it (tests/kernels: 1 and 2 threads;
# threads_per_worker); a user's engine keeps torch's default.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# OpenMP threads (torch's and the C kernels') that wait for work sleep instead of spinning. The suite keeps both cores
# busy, so a spinning thread takes the core its peer needs: the kernels' 2-thread cases in tests/kernels/test_ops.py
# took 60 s of the fast tier so, 4 s sleeping. Read by libgomp when torch loads it, so set before that too.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from devharness.model.builtin import write_hf_checkpoint  # noqa: E402

# The tests run the fast kernels as they ship, whatever `devharness bench kernels --save` chose on this machine: a
# cache of their own (set before any engine, worker or server process starts, so that they inherit it).
os.environ["DEVHARNESS_CACHE"] = str(Path(os.environ.get("DEVHARNESS_CACHE") or Path.home() / ".cache" / "devharness")
                                     / "tests")


# -- tiers -------------------------------------------------------------------------------------------------
# Every test gets one tier from where it lives (the markers are registered in pyproject.toml), and `ray` on top
# where it runs Ray (a Ray fixture, or "ray" in its name or parameters). `make test` runs them all; `make
# test-fast` leaves out ray, server, tui and gpu (no Ray, no server in a subprocess or a thread).
#   unit:   no engine: kernels against their references, configs, the CLI's parser, layout and docs rules
#   engine: an engine in the test's process or its workers' (uni, mp): engine, executor, debug, worker, diagnostics,
#           monitor
#   server: an HTTP server (in a thread or `devharness serve` in a subprocess), or a script run as a user would
#   tui:    the Textual app, headless
#   gpu:    CUDA and nccl (tests/gpu; they skip without a GPU)
TIER_OF_DIR = {"kernels": "unit", "model": "engine", "engine": "engine", "executor": "engine", "debug": "engine",
               "worker": "engine", "diagnostics": "engine", "monitor": "engine", "bench": "engine", "server": "server",
               "tui": "tui", "gpu": "gpu"}
# Modules outside tests/server that run a server, a user's script or a command under a debugger in a subprocess.
SERVER_MODULES = {"test_examples.py", "test_serve_breakpoint.py", "test_loopback.py", "test_same_numbers.py",
                  "test_code_breakpoints.py", "test_bench_cli.py", "test_replay_debug.py"}
TIERS = ("unit", "engine", "ray", "server", "tui", "gpu")


def tier_of(path: Path) -> str:
    parts = path.relative_to(Path(__file__).parent).parts
    if path.name in SERVER_MODULES:
        return "server"
    return TIER_OF_DIR.get(parts[0], "unit") if len(parts) > 1 else "unit"


# Fixtures of a module's scope that cost nothing to make twice (the Ray instance is one per test process anyway).
CHEAP_MODULE_FIXTURES = {"ray_instance", "torch_threads_restored"}
# Which modules `make test` starts first: the slowest kinds (Ray, servers), so that the many short unit tests fill
# the two processes' ends evenly instead of one process running a long module alone at the end.
START_ORDER = ("ray", "server", "tui", "engine", "gpu", "unit")


# Modules with a test that runs Ray (filled as the tests are collected).
RAY_MODULES: set[Path] = set()
# Servers of the session's scope that tests of several modules share (tests/server/conftest.py), by the fixture a test
# asks for: the tests that ask for one run in its xdist group, so that one test process runs them and starts it once.
SHARED_SERVER_GROUPS = {"uni_server": "tests/server: tiny-llama uni server"}


def xdist_group_of(item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    return None if mark is None else (mark.args[0] if mark.args else mark.kwargs.get("name"))


@pytest.hookimpl(tryfirst=True)   # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        marked = {m.name for m in item.iter_markers() if m.name in TIERS}
        if not marked - {"ray"}:
            item.add_marker(tier_of(Path(item.path)))
        words = set(re.split(r"[^a-z]+", Path(item.path).stem + " " + item.nodeid.lower().split("::", 1)[-1]))
        if "ray" in words or "ray_instance" in getattr(item, "fixturenames", ()):
            item.add_marker("ray")
        shared = [SHARED_SERVER_GROUPS[f] for f in getattr(item, "fixturenames", ()) if f in SHARED_SERVER_GROUPS]
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))
        # A module whose tests share an engine or a server of the module's scope runs in one test process
        # (`make test`: --dist loadgroup), so that the engine starts once, not once in each process.
        defs = getattr(item, "_fixtureinfo", None)
        if defs is not None and any(d[-1].scope in ("module", "package") and name not in CHEAP_MODULE_FIXTURES
                                    for name, d in defs.name2fixturedefs.items()) \
                and item.get_closest_marker("xdist_group") is None:   # modules that share a group keep theirs
            item.add_marker(pytest.mark.xdist_group(str(Path(item.path).relative_to(Path(__file__).parent))))
    # Modules stay whole (their fixtures set up once); a module starts as early as its slowest kind of test. Among
    # the Ray modules, those that start a Ray of their own (several nodes, a dashboard: they import own_ray) come after
    # those that share the process's instance, which they end: started again after them, it costs seconds of CPU.
    # Modules that share a group (a server of the session's scope) run one after another, at the first one's place,
    # so that a run without xdist starts that server once too.
    first, place = {}, {}
    for i, item in enumerate(items):
        first.setdefault(xdist_group_of(item) or item.path, i)
    for item in items:
        place[item.path] = min(place.get(item.path, len(items)), first[xdist_group_of(item) or item.path])
    rank = {}
    for item in items:
        kinds = {m.name for m in item.iter_markers() if m.name in TIERS}
        if "ray" in kinds:
            RAY_MODULES.add(item.path)
        mine = min((START_ORDER.index(k) for k in kinds), default=len(START_ORDER))
        rank[item.path] = min(rank.get(item.path, mine), mine)
    items.sort(key=lambda item: (rank[item.path], getattr(getattr(item, "module", None), "own_ray", None) is own_ray,
                                 place[item.path]))


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """The synthetic tiny Llama written as a Hugging Face checkpoint (config.json + safetensors + tokenizer)."""
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny-hf"))




@pytest.fixture(scope="module")
def ray_instance():
    """One local Ray instance, shared by every module that asks for it (starting one costs seconds) and
    shut down at the end of the run. A module that needs a Ray of its own (a dashboard, several nodes)
    calls own_ray() first."""
    import ray
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield


@pytest.fixture(scope="module", autouse=True)
def torch_threads_restored():
    """A module whose fixtures set torch's thread count (or run an engine in this process that does) does not leave
    it set for the modules after it."""
    import torch
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def torch_threads_restored_per_test():
    """Nor does a test leave it set for the tests after it in its module (the count it found is the one its module's
    fixtures left: they are set up before it)."""
    import torch
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


# Closers of what a session-scoped fixture keeps on the shared Ray instance (tests/server/conftest.py): they run
# before the instance ends, and the fixture starts its engine again if a later module asks.
RAY_BOUND: list = []


def own_ray() -> None:
    """Leave the shared Ray instance, if this process is connected to one."""
    import ray
    while RAY_BOUND:
        RAY_BOUND.pop()()
    if ray.is_initialized():
        ray.shutdown()


@pytest.hookimpl(trylast=True)   # after the module's own fixtures (an engine or server on Ray) are torn down
def pytest_runtest_teardown(item, nextitem):
    """The shared Ray instance ends when this process leaves the Ray modules (they come first), not at the end of
    the run: an idle Ray (its raylet, agents and idle workers) costs about 7% of a core. Only between modules: a
    module's Ray fixtures are set up once for all its tests."""
    if "ray" in sys.modules and (nextitem is None or nextitem.path not in RAY_MODULES):
        own_ray()


def pytest_sessionfinish(session, exitstatus):
    if "ray" in sys.modules:
        own_ray()
