"""Nothing listens where it need not: a run whose ranks are all on this machine opens no port off loopback,
nor makes a library open one (torch.distributed's store, gloo's pairs, the private Ray instance), seen from
outside the processes; across machines `serve` says what other machines can reach, and why. The served runs
(mp at tp=2 x pp=2; Ray at tp=2 with its own Ray instance) are looked at by assert_listens_on_loopback_only, called
from tests/server/test_health_release.py's SIGTERM test, which starts those servers anyway; the default `serve`
(uni at tp=1, no --debug: a first run's) here.
(tests/executor/test_ray_multinode.py has the multi-node half: the data plane on the nodes' own address.)"""
import ipaddress
import os
import re
import stat
import subprocess
import time
import types

import httpx
import psutil

from devharness.distributed.rendezvous import (Rendezvous, bind_backends, interface_of, local_rendezvous,
                                              remove_folder, tcp_rendezvous)
from tests.helpers import serve_process

# Ports of Ray's own that cannot be bound to loopback in the pinned Ray (docs/http.md, "What listens where"), by the
# name of the process that owns them. Ray 2.60 binds every port of an instance whose node address is
# 127.0.0.1 to loopback: none.
RAY_PORTS_OFF_LOOPBACK: dict[str, str] = {}

BODY = {"model": "tiny-llama", "prompt": [5, 17, 99, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def _run_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    """The server and every process of its run: its descendants, and (should Ray ever start them apart
    from it) the processes of the Ray session it started, found by the session folder on their command line,
    with their descendants."""
    root = psutil.Process(proc.pid)
    found = {p.pid: p for p in [root, *root.children(recursive=True)]}
    sessions = set()
    for p in list(found.values()):
        try:
            sessions |= set(re.findall(r"/session_\d[\w.-]*", " ".join(p.cmdline())))
        except psutil.Error:
            pass
    if sessions:
        for p in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(p.info["cmdline"] or ())
            if p.pid not in found and any(s in cmdline for s in sessions):
                for q in [p, *p.children(recursive=True)]:
                    found.setdefault(q.pid, q)
    return list(found.values())


def _listening(procs: list[psutil.Process]) -> dict[tuple, str]:
    """Every listening TCP socket of `procs`: (pid, address, port) -> the owner's name."""
    out = {}
    for p in procs:
        try:
            name = p.name()
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    out[(p.pid, c.laddr.ip, c.laddr.port)] = name
        except psutil.Error:   # a process that ended meanwhile
            pass
    return out


def _on_loopback(host: str) -> bool:
    addr = ipaddress.ip_address(host.split("%")[0])
    if addr.version == 6 and addr.ipv4_mapped is not None:   # ::ffff:127.0.0.1, a dual-stack socket's
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _listening_during(proc: subprocess.Popen, url: str) -> dict[tuple, str]:
    """After a completion: every socket the run's processes listen on, looked at twice a second apart (a port Ray
    opens a moment late is seen too)."""
    r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    seen: dict[tuple, str] = {}
    for _ in range(2):
        seen |= _listening(_run_processes(proc))
        time.sleep(1.0)
    return seen


def _off_loopback(seen: dict[tuple, str]) -> list[str]:
    return [f"{name} (pid {pid}) on {host}:{port}" for (pid, host, port), name in sorted(seen.items())
            if not _on_loopback(host) and name not in RAY_PORTS_OFF_LOOPBACK]


def assert_listens_on_loopback_only(proc: subprocess.Popen, lines: list[str], url: str, worker_pids: list[int],
                                    own_ray: bool) -> None:
    """What a served run listens on, seen from outside its processes, is all on loopback; not a vacuous pass:
    the server and every rank (its gloo pairs) were seen listening, and on Ray, Ray's own GCS and raylet. Called
    by tests/server/test_health_release.py's SIGTERM test on each executor (mp at tp=2 x pp=2, Ray at tp=2 with
    the private Ray instance `serve` starts), before it pauses a rank and ends the server."""
    seen = _listening_during(proc, url)
    assert not _off_loopback(seen), _off_loopback(seen)
    owners = {pid for pid, _, _ in seen}
    assert proc.pid in owners and set(worker_pids) <= owners, (worker_pids, seen)
    if own_ray:
        assert {"gcs_server", "raylet"} <= set(seen.values()), seen
    assert not any("reachable from other machines" in line for line in lines), lines


def test_the_default_serve_listens_on_loopback_only():
    """`devharness serve` with nothing but a model and a free port: uni at tp=1 without --debug, its worker in the
    server's own process."""
    proc, lines, url = serve_process()
    try:
        assert_listens_on_loopback_only(proc, lines, url, [proc.pid], own_ray=False)
        assert not any("debugpy on" in line for line in lines), lines   # the defaults: no debug listeners
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)   # its own session (serve_process): the server and anything it started
            proc.wait(10)


# -- the pieces, without a server -------------------------------------------------------------------------

def test_a_local_rendezvous_is_a_private_file_store_and_its_ranks_bind_loopback(monkeypatch):
    rendezvous, folder = local_rendezvous()
    try:
        assert rendezvous.local and rendezvous.store_address is None
        assert rendezvous.init_method == f"file://{folder}/store" and rendezvous.bind_address == "127.0.0.1"
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        lo = interface_of("127.0.0.1")
        assert lo is not None and lo.startswith("lo")
        # On one machine loopback wins over what the environment said (this process's environment only).
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth-something")
        monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
        assert bind_backends(rendezvous) == lo
        assert os.environ["GLOO_SOCKET_IFNAME"] == lo and os.environ["NCCL_SOCKET_IFNAME"] == "=" + lo
    finally:
        remove_folder(folder)
    assert not os.path.exists(folder)


def test_across_machines_the_store_and_backends_take_the_node_address(monkeypatch):
    rendezvous = tcp_rendezvous("127.0.0.1", 29511)
    assert not rendezvous.local and rendezvous.store_address == ("127.0.0.1", 29511)
    assert tcp_rendezvous("fd00::5", 7).init_method == "tcp://[fd00::5]:7"
    # The user's choice of interface stands across machines.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    bind_backends(rendezvous)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "mine" and os.environ["NCCL_SOCKET_IFNAME"].startswith("=")
    # An address no interface here holds (TEST-NET-3) leaves the choice to the backends.
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert interface_of("203.0.113.77") is None
    assert bind_backends(Rendezvous("tcp://203.0.113.77:1", "203.0.113.77")) is None
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_serve_prints_one_line_naming_what_other_machines_reach():
    from devharness.server.app import banner
    from devharness.server.auth import ServerAuth
    line = "devharness: reachable from other machines: torch.distributed's store at 10.0.0.5:4000 (why)"

    def llm_with(exposure):
        config = types.SimpleNamespace(debug=types.SimpleNamespace(enabled=False),
                                       parallel=types.SimpleNamespace(world_size=2))
        workers = types.SimpleNamespace(exposure=lambda: exposure)
        return types.SimpleNamespace(model_name="tiny-llama", engine=types.SimpleNamespace(config=config, workers=workers))

    text = banner(llm_with(line), ("127.0.0.1", 8000), ServerAuth()).splitlines()
    assert text[1] == line and sum("reachable from other machines" in t for t in text) == 1
    assert not any("reachable" in t for t in banner(llm_with(None), ("127.0.0.1", 8000), ServerAuth()).splitlines())


def test_a_ray_cluster_joined_by_address_is_named_even_with_every_rank_here(monkeypatch):
    """--ray-address with every rank on the driver's node: the data plane stays on loopback, but Ray's own
    ports are the cluster's, on its nodes' addresses."""
    import ray
    from devharness.executor import ray as ray_executor
    from devharness.executor.ray_utils import Resources
    ex = object.__new__(ray_executor.RayExecutor)
    ex.config = types.SimpleNamespace(model=types.SimpleNamespace(device="cpu"))
    ex.node_ids, ex.node_ips, ex.driver_node = ["a", "a"], ["10.0.0.5", "10.0.0.5"], "a"
    ex.rendezvous = Rendezvous("file:///nowhere/store")
    ex._res = Resources(started_ray=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.5")
    line = ex.exposure()
    assert line.startswith("devharness: reachable from other machines: Ray's own on 10.0.0.5"), line
    assert "store" not in line and "step channel" not in line
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")   # its own Ray: nothing
    assert ex.exposure() is None


def test_the_private_ray_is_started_on_the_loopback_node_address(monkeypatch):
    """Ray turns 127.0.0.1 into the machine's routable address unless it runs without clusters: that mode
    holds while the private instance starts, and only then."""
    import ray
    from ray._private import ray_constants

    from devharness.executor import ray_utils
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append((kw, ray_constants.ENABLE_RAY_CLUSTER)))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    before = ray_constants.ENABLE_RAY_CLUSTER
    assert ray_utils.connect(None, world_size=2)
    (kw, cluster_mode), = calls
    assert kw["address"] == "local" and kw["_node_ip_address"] == "127.0.0.1" and kw["dashboard_host"] == "127.0.0.1"
    assert cluster_mode is False and ray_constants.ENABLE_RAY_CLUSTER == before
