"""The Ray executor's helpers: joining a cluster, ordering bundles, reading Ray's errors, and the
resources an executor holds (released once, by shutdown() or at interpreter exit)."""
from __future__ import annotations

import contextlib
import logging
import os
from multiprocessing import shared_memory
from pathlib import Path

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.placement_group import remove_placement_group

import devharness
from devharness.distributed.rendezvous import LOOPBACK, is_loopback, remove_folder
from devharness.protocol.frames import EXIT

logger = logging.getLogger(__name__)

SHUTDOWN_WAIT_S = 5.0


def bundles_in_rank_order(pg) -> list[int]:
    """Bundle indices for ranks 0, 1, ...: grouped by node, the driver's node first. A TP group
    (consecutive ranks) then shares a node where it fits, and rank 0, host of torch.distributed's
    rendezvous, sits beside the driver."""
    node_of = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    driver_node = ray.get_runtime_context().get_node_id()
    first_bundle = {}
    for b in sorted(node_of):
        first_bundle.setdefault(node_of[b], b)
    return sorted(node_of, key=lambda b: (node_of[b] != driver_node, first_bundle[node_of[b]], b))


def error_of(ref) -> RayError | None:
    try:
        ray.get(ref, timeout=0)
    except RayError as e:
        return e
    return None


def brief(err: RayError) -> str:
    """One line for a WorkerError; the full Ray error (remote traceback included) stays chained to it."""
    if isinstance(err, RayTaskError):
        cause = getattr(err, "cause", None)
        return f"{type(cause).__name__}: {cause}" if cause is not None else str(err).strip().splitlines()[-1]
    if not isinstance(err, RayActorError):
        return str(err)
    # Ray's report of a death runs to a dozen lines; its first line and the reason say enough.
    lines = str(err).splitlines() or [repr(err)]
    reason = next((line.split(". ")[0] + "." for line in lines if "because" in line), "")
    return f"{lines[0]} {reason}".strip()


def connect(address: str | None, world_size: int) -> bool:
    """Join the given cluster (or RAY_ADDRESS's), else start a private local one, unless Ray is up in this
    process already; True when this call did either. Without an address Ray would join whatever local
    cluster it finds (a `ray start`, another engine's): a run is not placed on a cluster by accident."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        # The cluster's nodes need torch and the other dependencies, but not this package: it travels
        # with the job (Ray's py_modules), the version the driver runs.
        ray.init(address=address, runtime_env={"py_modules": [str(Path(devharness.__file__).parent)],
                                               "excludes": ["__pycache__"]})
    else:
        _start_private_ray(world_size)
    return True


def _start_private_ray(world_size: int) -> None:
    """A Ray instance for this run alone, every port of it on loopback.

    Ray binds its GCS, raylet, object manager, agents, metrics exporters and every worker's gRPC server to
    loopback when the node's address is a loopback one, and to every interface otherwise. On Linux it turns
    the node address 127.0.0.1 into the machine's routable one, unless Ray runs "without clusters" (its
    mode on macOS and Windows, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0): that mode is set only while this
    instance starts, since its processes keep the address they were started with. The dashboard can stop
    and start jobs: loopback too, said here rather than left to Ray's default."""
    from ray._private import ray_constants
    had_mode = hasattr(ray_constants, "ENABLE_RAY_CLUSTER")
    cluster_mode = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        # Logical CPUs: a 2-core laptop must still place 4 CPU workers (each worker's threads are set apart).
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, world_size), dashboard_host=LOOPBACK,
                 _node_ip_address=LOOPBACK)
    finally:
        if had_mode:
            ray_constants.ENABLE_RAY_CLUSTER = cluster_mode
        else:
            del ray_constants.ENABLE_RAY_CLUSTER
    node_ip = ray.util.get_node_ip_address()
    if not is_loopback(node_ip):
        logger.warning("the private Ray instance took node address %s, not loopback: its ports listen on every "
                       "interface (this Ray version ignores the loopback address asked for)", node_ip)


def dashboard_url() -> str | None:
    # Ray has no public getter for a connected driver (ray.init's return value has it, when we called it).
    try:
        from ray._private.worker import get_dashboard_url
        return get_dashboard_url() or None
    except Exception:
        return None


class Resources:
    """What an executor holds in Ray and shared memory; released once, by shutdown() or at exit.

    Kept apart from the executor so weakref.finalize can release it without keeping the executor alive.
    """

    def __init__(self, started_ray: bool):
        self.started_ray = started_ray
        self.failed: str | None = None   # the first WorkerError's message
        self.actors: list = []
        self.pg = None
        self.dag = None
        self.liveness: list = []
        self.queue = None       # driver -> workers (shm ring on this node, TCP to others; TCP answers too)
        self.responses: dict = {}   # rank -> its answers' ring, for each rank on this node that answers steps
        self.rendezvous_folder: str | None = None   # the file store's, when every rank is on this machine

    def release(self) -> None:
        if ray.is_initialized():
            self._release_ray()
        for ch in (self.queue, *self.responses.values()):
            if ch is not None:
                _quietly(ch.close)
        for ring in self.responses.values():
            # A rank owns its answers' ring; killed before its loop ended, it leaves it behind.
            _quietly(_unlink_shm, ring.name)
        self.queue, self.responses = None, {}
        remove_folder(self.rendezvous_folder)
        self.rendezvous_folder = None
        if self.started_ray and ray.is_initialized():
            ray.shutdown()

    def _release_ray(self) -> None:
        if self.failed:
            # The graph's monitor may already be tearing down, stuck on a rank blocked in a collective:
            # kill first so neither waits on the other. Ray's graph logs every cancel that then fails,
            # a traceback per actor, all expected here.
            dag_log = logging.getLogger("ray.dag.compiled_dag_node")
            level = dag_log.level
            dag_log.setLevel(logging.CRITICAL)
            try:
                self._kill_actors()
                if self.dag is not None:
                    _quietly(self.dag.teardown)
            finally:
                dag_log.setLevel(level)
        elif self.dag is not None:
            _quietly(self.dag.teardown)
        if not self.failed and self.liveness and self.dag is None:
            if self.queue is not None:
                _quietly(self.queue.write, EXIT, timeout_s=1.0)
            # Let the loops see EXIT and close their channels (the output rank unlinks its result ring).
            _quietly(ray.wait, self.liveness, num_returns=len(self.liveness), timeout=SHUTDOWN_WAIT_S)
        self._kill_actors()
        if self.pg is not None:
            _quietly(remove_placement_group, self.pg)
        self.pg, self.dag, self.liveness = None, None, []

    def _kill_actors(self) -> None:
        for a in self.actors:
            _quietly(ray.kill, a, no_restart=True)
        # A call to a killed actor fails once Ray has seen its process go: wait for that, so that
        # no worker outlives shutdown().
        probes = [p for p in (_quietly(a.node_info.remote) for a in self.actors) if p is not None]
        if probes:
            _quietly(ray.wait, probes, num_returns=len(probes), timeout=SHUTDOWN_WAIT_S)
        self.actors = []


def _unlink_shm(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        segment = shared_memory.SharedMemory(name=name)
        segment.close()
        segment.unlink()


def _quietly(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # shutdown goes on past a dead actor or a closed channel
        logger.debug("shutdown: %s failed: %s", getattr(fn, "__name__", fn), e)
        return None
