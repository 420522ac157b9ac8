"""What a worker's debugpy listener costs to start: debugpy describes the environment (every installed package's
metadata) only where a log receives the description, and a worker that is not on Ray does not import Ray to share
Ray's post-mortem (each was more than a second of CPU per debug-mode worker)."""
import socket
import subprocess
import sys
import textwrap

from debugpy.common import log

from devharness.debug import debugger
from tests.helpers import free_port_base


def test_environment_is_described_only_into_a_log(monkeypatch):
    debugger._describe_environment_only_to_a_log()
    debugger._describe_environment_only_to_a_log()    # once wrapped, not twice
    read = []
    monkeypatch.setattr(log.importlib_metadata, "distributions", lambda: read.append(1) or iter(()))
    monkeypatch.setattr(log, "log_dir", None)
    log.describe_environment("no log")
    assert read == []
    monkeypatch.setattr(log, "log_dir", "/nonexistent-log-dir")
    log.describe_environment("a log directory")
    assert read == [1]
    monkeypatch.setattr(log, "log_dir", None)
    monkeypatch.setattr(log.stderr, "_levels", frozenset(log.LEVELS))    # DEBUGPY_LOG_STDERR with info in it
    log.describe_environment("info to stderr")
    assert read == [1, 1]


def test_a_worker_elsewhere_shares_no_post_mortem_and_imports_nothing_for_it():
    script = textwrap.dedent("""
        import sys
        from devharness.debug import debugger
        debugger.share_ray_post_mortem()
        assert "ray" not in sys.modules, "share_ray_post_mortem imported Ray"
        import ray.util
        debugger.share_ray_post_mortem()   # with Ray imported (a Ray worker), Ray's post-mortem is routed to ours
        assert getattr(ray.util.ray_debugpy._post_mortem, "_devharness", False)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_debug_port_taken_is_one_line_naming_the_flag_and_exit_2():
    """`serve --debug` where a rank's debugpy port is taken (here rank 1's, at tp=2 on mp): one line naming
    --debug-port-base, exit 2, before any worker starts; no traceback."""
    # Ports below the ephemeral range: an ephemeral base once lost rank 0's port to someone's outgoing connection.
    port = free_port_base(2) + 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        done = subprocess.run([sys.executable, "-m", "devharness.cli", "serve", "--model", "tiny-llama", "--tp", "2",
                               "--executor", "mp", "--port", "0", "--debug", "--debug-port-base", str(port - 1)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert lines == [f"devharness: error: rank 1's debug port 127.0.0.1:{port} (--debug-port-base {port - 1} + 1) "
                     "cannot be listened on (Address already in use): pick another --debug-port-base"], done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_a_debug_port_taken_after_the_check_names_the_flag_too():
    """A port taken between the check and the worker's listen (or on another node) fails as a ValueError naming
    --debug-port-base, not debugpy's RuntimeError."""
    script = textwrap.dedent("""
        import socket
        from devharness.debug import debugger
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            try:
                debugger.start_listener("127.0.0.1", port)
            except ValueError as e:
                assert f"debug port 127.0.0.1:{port} cannot be listened on" in str(e) and "--debug-port-base" in str(e), e
            else:
                raise AssertionError("listened on a taken port")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
