"""Looking into a worker from outside, without its cooperation: Python stacks via py-spy.

A worker hung in a collective or stopped in a debugger cannot answer a call; py-spy reads its
stacks from the process's memory. For a worker on another node, a Ray task on that node runs
py-spy there.
"""
from __future__ import annotations

import shutil
import subprocess

from devharness.debug.redact import redact


class StackError(RuntimeError):
    """A stack could not be read; the message says why and what to do."""


def py_spy_path() -> str:
    path = shutil.which("py-spy")
    if path is None:
        raise StackError("py-spy is not installed (it comes with ray[default]; or: python3 -m pip install py-spy)")
    return path


def process_stopped(pid: int) -> bool:
    """Whether local process `pid` is stopped by a signal (SIGSTOP, SIGTSTP: process state T): it runs no code."""
    import psutil
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def dump_stacks(pid: int, timeout_s: float = 20.0, locals_: bool = False) -> str:
    """Every thread's Python stack of process `pid`, innermost frame first, after the process's command
    line, secrets masked (debug/redact.py): a server's rank 0 is the server, `--api-key K` and all."""
    cmd = [py_spy_path(), "dump", "--pid", str(pid)]
    if locals_:
        cmd.append("--locals")
    stopped = process_stopped(pid)
    if stopped:   # py-spy's own suspend (ptrace) fails on a stopped process; it stands still already
        cmd.append("--nonblocking")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise StackError(f"py-spy dump of pid {pid} took over {timeout_s:.0f} s") from None
    if res.returncode != 0:
        msg = (res.stderr or res.stdout).strip().splitlines()
        hint = " (reading another process needs ptrace permission: run as the same user, or as root)" \
            if any("ermission" in m for m in msg) else ""
        raise StackError(redact(f"py-spy dump of pid {pid} failed: {msg[-1] if msg else res.returncode}{hint}"))
    note = f"(process {pid} is stopped: SIGSTOP, process state T; read without suspending it)\n" if stopped else ""
    return redact(res.stdout + note)


def dump_stacks_on_node(node_id: str, pid: int, timeout_s: float = 30.0) -> str:
    """The same, for a worker on another Ray node: py-spy runs there (see on_node)."""
    return on_node(node_id, dump_stacks, pid, timeout_s, timeout_s=timeout_s + 30)


def on_node(node_id: str, fn, *args, timeout_s: float = 60.0):
    """fn(*args) on Ray node `node_id`, in a task pinned there: it asks for no CPU (the workers may
    hold them all) and needs nothing from the workers; Ray carries it, so no dashboard, profiling
    switch or open port is involved. A StackError raised there is raised here."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    task = ray.remote(num_cpus=0, max_retries=0)(fn).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    ref = task.remote(*args)
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        raise StackError(f"no answer from node {node_id[:12]} within {timeout_s:.0f} s") from None
    except ray.exceptions.RayTaskError as e:
        cause = e.as_instanceof_cause()
        raise StackError(str(cause.cause) if isinstance(cause.cause, StackError) else
                         f"{getattr(fn, '__name__', fn)} on node {node_id[:12]} failed: {str(e).splitlines()[0]}") \
            from None
