"""Looking into a worker from outside, without its cooperation: Python stacks via py-spy.

A worker hung in a collective or stopped in a debugger cannot answer a call; py-spy reads its
stacks from the process's memory. Workers on another node are reached through the Ray
dashboard agent of that node, which runs py-spy there.
"""
from __future__ import annotations

import shutil
import subprocess


class ProbeError(RuntimeError):
    """A stack could not be read; the message says why and what to do."""


def py_spy_path() -> str:
    path = shutil.which("py-spy")
    if path is None:
        raise ProbeError("py-spy is not installed (it comes with ray[default]; or: python3 -m pip install py-spy)")
    return path


def dump_stacks(pid: int, timeout_s: float = 20.0, locals_: bool = False) -> str:
    """Every thread's Python stack of process `pid`, innermost frame first."""
    cmd = [py_spy_path(), "dump", "--pid", str(pid)]
    if locals_:
        cmd.append("--locals")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ProbeError(f"py-spy dump of pid {pid} took over {timeout_s:.0f} s") from None
    if res.returncode != 0:
        msg = (res.stderr or res.stdout).strip().splitlines()
        hint = " (reading another process needs ptrace permission: run as the same user, or as root)" \
            if any("ermission" in m for m in msg) else ""
        raise ProbeError(f"py-spy dump of pid {pid} failed: {msg[-1] if msg else res.returncode}{hint}")
    return res.stdout


def dump_stacks_via_ray(dashboard_url: str, node_ip: str, pid: int, timeout_s: float = 20.0) -> str:
    """The same, for a worker on another node: that node's Ray dashboard agent runs py-spy there."""
    import httpx
    base = dashboard_url if dashboard_url.startswith("http") else f"http://{dashboard_url}"
    url = f"{base}/worker/traceback"
    try:
        r = httpx.get(url, params={"pid": pid, "ip": node_ip, "native": "0"}, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise ProbeError(f"Ray dashboard at {base} unreachable: {e}") from None
    if r.status_code != 200:
        raise ProbeError(f"Ray dashboard could not dump pid {pid} on {node_ip}: {r.text[:200]}")
    return r.text
