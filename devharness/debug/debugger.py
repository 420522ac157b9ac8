"""debugpy in a worker: one listener per process on host:(port_base + rank), shared with Ray's debugger.

`debugpy.listen` may run once per process. Ray's own debugger (RAY_DEBUG=1) opens a listener on
demand unless the worker already has a debugger port registered with Ray, so we register ours:
then `breakpoint()` and Ray's post-mortem both use this one listener. Our breakpoint hook waits
for a client (a bare debugpy hook would run straight past with none attached), marks the worker
paused in its own state (Ray's state API does not), and stops in the caller's frame.
"""
from __future__ import annotations

import builtins
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from typing import Iterable

from devharness.debug import state as debug_state
from devharness.protocol.messages import PausedInfo

logger = logging.getLogger(__name__)

MIN_DEBUGPY = "1.8.0"

# Guards the process's single debugpy listener.
_listener_lock = threading.Lock()
_listener: tuple[str, int] | None = None


def _import_debugpy():
    # pydevd warns on every start that frozen stdlib modules may hide breakpoints in the stdlib;
    # the workers' code is never frozen, so the warning is only noise in every worker's log.
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    try:
        import debugpy
    except ImportError:
        raise RuntimeError("debug mode needs debugpy: python3 -m pip install 'debugpy>=1.8'") from None
    from packaging.version import Version
    if Version(debugpy.__version__) < Version(MIN_DEBUGPY):
        raise RuntimeError(f"debug mode needs debugpy >= {MIN_DEBUGPY}, found {debugpy.__version__}: "
                           "python3 -m pip install -U debugpy")
    _describe_environment_only_to_a_log()
    return debugpy


def _describe_environment_only_to_a_log() -> None:
    """debugpy.listen writes a description of the environment to its log: the name and version of every
    installed package, read from each one's metadata (1.3 s of CPU per worker with some 900 installed). It
    builds that text before it knows whether anything will receive it, and without a log directory
    (DEBUGPY_LOG_DIR, debugpy.log_to) or info-level stderr nothing does. Then the description is skipped;
    with a log it is written as before."""
    try:
        from debugpy.common import log
    except ImportError:   # debugpy's internals moved: it describes the environment as it always did
        return
    describe = getattr(log, "describe_environment", None)
    if describe is None or getattr(describe, "_devharness", False):
        return

    def describe_environment(header):
        files = getattr(log, "_files", None)
        received = files is None or any("info" in getattr(f, "levels", ("info",)) for f in files.values())
        if received or log.log_dir is not None:
            describe(header)

    describe_environment._devharness = True
    log.describe_environment = describe_environment


# How long a worker waits for its debug port to be freed (by a predecessor's exiting debugpy adapter).
PORT_FREE_WAIT_S = 5.0


def _cannot_listen(host: str, port: int) -> str | None:
    """Why nothing could listen on host:port now (taken, a port out of range), or None."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as debugpy listens
            sock.bind(addr)
    except (OSError, OverflowError) as e:
        return getattr(e, "strerror", None) or str(e)
    return None


def check_ports_free(host: str, port_base: int, ranks: Iterable[int]) -> None:
    """ValueError naming --debug-port-base when some rank's debugpy port (port_base + rank) cannot be listened on:
    looked at before any worker starts, since each would fail alone, its traceback and then the driver's."""
    for rank in ranks:
        port = port_base + rank
        if (why := _cannot_listen(host, port)) is not None:
            raise ValueError(f"rank {rank}'s debug port {host}:{port} (--debug-port-base {port_base} + {rank}) cannot "
                             f"be listened on ({why}): pick another --debug-port-base")


def start_listener(host: str, port: int) -> tuple[str, int]:
    """Listen for DAP clients once per process; later calls return the existing address."""
    global _listener
    with _listener_lock:
        if _listener is not None:
            return _listener
        debugpy = _import_debugpy()
        from devharness.config import DebugConfig
        if not DebugConfig(host=host).host_is_loopback:
            logger.warning("debugpy listens on %s:%d, reachable from other machines: anyone who connects "
                           "can run any code in this worker", host, port)
        # Taken since check_ports_free looked, or on another node: debugpy's own error would be a RuntimeError
        # with a traceback through its internals. A worker restarted in place of a killed one may find the port
        # still held for a moment (the killed worker's debugpy adapter, a process of its own, exits after it).
        deadline = time.monotonic() + PORT_FREE_WAIT_S
        while (why := _cannot_listen(host, port)) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        if why is not None:
            raise ValueError(f"debug port {host}:{port} cannot be listened on ({why}): pick another --debug-port-base")
        _listener = tuple(debugpy.listen((host, port)))
        _register_with_ray(_listener[1])
        share_ray_post_mortem()
        install_breakpoint_hook()
        _start_watcher()
        return _listener


# The recorder the watcher thread publishes to: the listening worker's (one listener per process). The thread
# runs outside any worker's step, so it is handed the recorder rather than finding it in the step's scope.
_watched = None


def watch(recorder) -> None:
    """Have the watcher publish a client attaching and a stop from the IDE to `recorder` (None: to no one)."""
    global _watched
    _watched = recorder


def _start_watcher(interval_s: float = 0.2) -> None:
    """A thread the debugger neither traces nor suspends: it notices a client attaching and a thread
    stopped at a breakpoint set from the IDE (which passes no hook of ours), and publishes both."""
    t = threading.Thread(target=_watch, args=(interval_s,), name="devharness-debug-watcher", daemon=True)
    t.pydev_do_not_trace = True        # pydevd skips threads marked as its own
    t.is_pydev_daemon_thread = True
    t.start()


def _suspended_frame():
    """(file, line) where a thread is stopped by the debugger, or None."""
    try:
        import pydevd
        from _pydevd_bundle.pydevd_constants import STATE_SUSPEND
    except ImportError:
        return None
    py_db = pydevd.get_global_debugger()
    if py_db is None:
        return None
    frames = sys._current_frames()
    for t in threading.enumerate():
        info = getattr(t, "additional_info", None)
        if info is None or getattr(info, "pydev_state", None) != STATE_SUSPEND or t.ident not in frames:
            continue
        # Innermost frames are the debugger's wait (and the threading calls it makes): the stopped
        # user frame is the first one above the debugger's own frames.
        frame, seen_debugger = frames[t.ident], False
        while frame is not None:
            is_debugger = py_db.get_file_type(frame) == py_db.PYDEV_FILE
            if seen_debugger and not is_debugger:
                return frame.f_code.co_filename, frame.f_lineno
            seen_debugger |= is_debugger
            frame = frame.f_back
    return None


# How long a pause announced before the debugger holds the thread is kept while the thread is not seen stopped.
PAUSE_GRACE_S = 5.0


def _watch(interval_s: float) -> None:
    import debugpy
    seen = None   # the pause this watcher has seen the debugger hold the thread in
    while True:
        time.sleep(interval_s)
        rec = _watched
        if rec is None or rec.state.debugpy is None:
            continue
        st = rec.state
        changed = False
        connected = debugpy.is_client_connected()
        if connected != st.debugpy.client_connected:
            st.debugpy.client_connected, changed = connected, True
        where = _suspended_frame() if connected else None
        if where is not None and (st.paused is None or (st.paused.file, st.paused.line) != where):
            reason = st.paused.reason if st.paused is not None and st.paused.reason == "exception" else "breakpoint"
            st.paused, changed = PausedInfo(reason, where[0], where[1], time.time()), True
        elif where is None and st.paused is not None and st.paused.reason != "waiting_for_client" and connected \
                and (st.paused is seen or time.time() - (st.paused.since or 0) > PAUSE_GRACE_S):
            # A pause wait_for_client just announced is kept until the debugger has been seen to hold the
            # thread (or for PAUSE_GRACE_S): between the client attaching and the thread stopping, the
            # state would otherwise flicker to "not paused".
            st.paused, changed = None, True
        if where is not None:
            seen = st.paused
        if changed:
            # The worker's thread may change phase while this publishes; then publish its latest too.
            for _ in range(3):
                key = rec.phase_key()
                rec.publish()
                if rec.phase_key() == key:
                    break


def _register_with_ray(port: int) -> None:
    # Ray keeps the debugger port of a worker in its private worker object; there is no public API.
    # With the port registered, Ray's set_trace / post-mortem reuse our listener instead of opening one.
    ray = sys.modules.get("ray")   # not imported: not a Ray worker
    try:
        worker = ray._private.worker.global_worker
        if worker.connected and worker.mode == ray.WORKER_MODE:
            worker.set_debugger_port(port)
    except Exception:  # not in a Ray worker
        pass


def share_ray_post_mortem() -> None:
    """Route Ray's post-mortem through ours; a Ray actor calls this as it starts.

    With RAY_DEBUG_POST_MORTEM=1 Ray pauses a task that raises. A worker exception we already paused
    on would then stop the debugger a second time; any other goes through our post-mortem, so the
    worker's state says it is paused on an exception. Before our listener is up (a worker failing
    to start) nothing pauses: Ray's own would open a listener on the node's address and wait there
    for ever, where the driver only needs the error. Ray looks the hook up on this module per call."""
    ray = sys.modules.get("ray")   # not imported: not a Ray worker, no post-mortem of Ray's to share
    if ray is None:
        return
    try:
        import ray.util
    except ImportError:
        return
    module = getattr(ray.util, "ray_debugpy", None)
    if module is None or getattr(module._post_mortem, "_devharness", False):
        return

    def shared_post_mortem():
        exc = sys.exc_info()[1]
        if exc is not None and _listener is not None and not getattr(exc, "_devharness_post_mortem_done", False):
            post_mortem(exc)

    shared_post_mortem._devharness = True
    module._post_mortem = shared_post_mortem


# Whether each step thread is traced by the debugger now (absent: never announced to it).
_thread_tracing: dict[int, bool] = {}


def sync_tracing() -> None:
    """Trace the calling (step) thread exactly while a client is attached; called at each step start.

    With no client, debugpy's trace function still runs on every line and slows a worker by a
    fifth or more, so it is switched off. Once a client attaches, the next step is traced and IDE
    breakpoints hit. Ray runs actor tasks on threads its C++ core made, which debugpy never sees
    unless each one announces itself (debug_this_thread)."""
    if _listener is None:
        return
    import debugpy
    ident = threading.get_ident()
    want = debugpy.is_client_connected()
    have = _thread_tracing.get(ident)
    if have == want:
        return
    if want and have is None:
        debugpy.debug_this_thread()
    else:
        debugpy.trace_this_thread(want)
    _thread_tracing[ident] = want


def client_connected() -> bool:
    if _listener is None:
        return False
    import debugpy
    return debugpy.is_client_connected()


@contextlib.contextmanager
def _ray_paused():
    """Ray marks the task as paused by a debugger (what Ray's debugger extension lists)."""
    ray = sys.modules.get("ray")   # not imported: not a Ray worker
    try:
        worker = ray._private.worker.global_worker
        ctx = worker.worker_paused_by_debugger() if worker.connected and worker.mode == ray.WORKER_MODE \
            else contextlib.nullcontext()
    except Exception:
        ctx = contextlib.nullcontext()
    with ctx:
        yield


RELEASE_POLL_S = 0.05


def wait_for_client(reason: str, frame) -> bool:
    """Block until a DAP client is attached (True), or until someone releases this worker without one
    (POST /debug/release: False, and the worker goes on), with the worker's state saying where and why."""
    debugpy = _import_debugpy()
    rec = debug_state.current_recorder()
    waiting = not debugpy.is_client_connected()
    where = f"{reason} at {frame.f_code.co_filename}:{frame.f_lineno}"
    if waiting:   # logged before the state says paused: whoever sees the pause finds the line in the log
        logger.info("waiting for a debugger on %s:%s (%s; POST /debug/release goes on without one)",
                    *(_listener or ("?", "?")), where)
    if rec is not None:
        rec.set_paused(reason, frame.f_code.co_filename, frame.f_lineno)
    if waiting:
        with _ray_paused():
            attached = _wait_for_client_or_release(debugpy, rec.release_path if rec is not None else None)
        if not attached:
            logger.info("released with no debugger attached (%s); going on", where)
            if rec is not None:
                rec.clear_paused()
            return False
    if rec is not None and rec.state.debugpy is not None:
        rec.state.debugpy.client_connected = True
        rec.publish()
    return True


def _wait_for_client_or_release(debugpy, release_path) -> bool:
    # A release file left from an earlier pause (a client attached before it was read) is not for this one.
    if release_path is not None:
        release_path.unlink(missing_ok=True)
    while not debugpy.is_client_connected():
        if release_path is not None and release_path.exists():
            release_path.unlink(missing_ok=True)
            return False
        time.sleep(RELEASE_POLL_S)
    debugpy.wait_for_client()   # attached: returns once the client has sent its breakpoints (configurationDone)
    return True


def pause_here(frame, reason: str = "breakpoint") -> None:
    """Stop the calling thread in `frame` under the attached debugger (waiting for one first)."""
    if _listener is None:
        logger.warning("breakpoint at %s:%d ignored: debug mode is off", frame.f_code.co_filename, frame.f_lineno)
        return
    if not wait_for_client(reason, frame):
        return
    import pydevd
    pydevd.settrace(suspend=True, trace_only_current_thread=True, patch_multiprocessing=False,
                    stop_at_frame=frame)


def post_mortem(exc: BaseException) -> None:
    """Pause on an exception raised in this worker: the attached client sees it as a stopped event."""
    exc._devharness_post_mortem_done = True
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame if tb is not None else sys._getframe(1)
    if not wait_for_client("exception", frame):
        return
    import pydevd
    py_db = pydevd.get_global_debugger()
    if py_db is None:
        return
    thread = threading.current_thread()
    info = py_db.set_additional_thread_info(thread)
    info.is_tracing += 1
    try:
        py_db.stop_on_unhandled_exception(py_db, thread, info, (type(exc), exc, exc.__traceback__))
    finally:
        info.is_tracing -= 1
    # The exception goes on up; where no Python frame catches it (a Ray task thread) the debugger would
    # stop again as "uncaught". The user has seen it: stop tracing this thread.
    import debugpy
    debugpy.trace_this_thread(False)
    _thread_tracing[threading.get_ident()] = False


def _breakpoint_hook(*args, **kwargs) -> None:
    pause_here(sys._getframe(1), "breakpoint")


def install_breakpoint_hook() -> None:
    # debugpy installs its own hook (a no-op without a client); ours waits for one.
    sys.breakpointhook = _breakpoint_hook
    builtins.breakpoint = _breakpoint_hook
