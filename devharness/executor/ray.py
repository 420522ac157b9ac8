"""RayExecutor: one Ray actor per rank in a placement group, driven once per step through a
Ray Compiled Graph ("cgraph") or a shared-memory ring with a TCP fallback for other nodes ("shm").

Ranks follow `rank = pp_rank * tp_size + tp_rank` and fill the placement group's bundles node by node,
the driver's node first.
Only the last PP stage's TP rank 0 returns sampled tokens (the output rank); e.g. tp=2, pp=2:
ranks 0,1 run stage 0 and send activations to ranks 2,3; rank 2 samples. With the KV sanitizer every
rank answers each step on the "shm" plane, as each returns its result in a compiled graph: a KV checksum
alarm may come from any rank (debug/kv_checksums.py).
"""
from __future__ import annotations

import contextlib
import logging
import time
import uuid
import weakref

import msgspec
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelTimeoutError, RayError, RayTaskError
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from devharness.distributed.rendezvous import Rendezvous, is_loopback, local_rendezvous, tcp_rendezvous
from devharness.executor.base import Executor, StepFuture, with_kv_alarms
from devharness.protocol.errors import WorkerDied, WorkerError
from devharness.executor.ray_utils import Resources, bundles_in_rank_order, brief, connect, dashboard_url, error_of
from devharness.executor.ray_worker import RayWorker
from devharness.protocol.messages import InitDevice, LoadModel, ModelRunnerOutput, SchedulerOutput
from devharness.diagnostics.hang import hang_report
from devharness.protocol.frames import Reply, StepCall, encoder, output_decoder, reply_decoder

logger = logging.getLogger(__name__)

# While a step runs, the driver looks up this often to see whether every actor is still alive.
_LIVENESS_POLL_S = 0.25
# A step message waiting this long for room on the ring looks at the actors' health (and the output rank's answers).
_STALL_CHECK_S = 1.0
# After an error, how long Ray gets to report which actor died (it learns within about a second).
_DEATH_REPORT_S = 3.0
_STARTUP_TIMEOUT_S = 600.0


class RayExecutor(Executor):
    """Ranks as Ray actors; `config.parallel.ray_control_plane` picks how each step reaches them."""

    uses_ray = True

    def _init_workers(self) -> None:
        p, d = self.config.parallel, self.config.debug
        # A worker at a breakpoint stalls the whole step: in debug mode a step may last as long as a human needs.
        self.step_timeout_s = d.timeout_s if d.enabled else p.step_timeout_s
        # Starting actors (a runtime_env, a model load) can outlast a short step timeout.
        self.startup_timeout_s = max(self.step_timeout_s, _STARTUP_TIMEOUT_S)
        self.mode = p.ray_control_plane
        self.id = uuid.uuid4().hex[:8]
        self.output_rank = self.world_size - p.tensor_parallel_size
        self.actors: list = []
        self.node_ids: list[str] = []
        self.node_ips: list[str] = []
        self.worker_pids: list[int] = []
        self.driver_node: str | None = None
        self.rendezvous: Rendezvous | None = None
        self._seq = 0
        self._step = 0
        # The ranks that answer steps ("shm"): the output rank first, then (KV sanitizer) every other one.
        others = [r for r in range(self.world_size) if r != self.output_rank]
        self.answering = [self.output_rank] + (others if self.config.scheduler.kv_sanitizer else [])
        # Step answers read before their caller asked for them: rank -> seq -> answer.
        self._early: dict[int, dict[int, Reply]] = {r: {} for r in self.answering}
        self._res = Resources(started_ray=connect(p.ray_address, self.world_size))
        self.dashboard_url = dashboard_url()
        try:
            self._place_workers()
            self._start_workers()
            if self.mode == "cgraph":
                self._compile_graph()
            else:
                self._start_loops()
        except BaseException:
            self._res.release()
            raise
        # Made last: at interpreter exit finalizers run newest first, so this one runs while the
        # shm ring (whose own finalizer unmaps it) can still carry EXIT to the workers.
        self._finalizer = weakref.finalize(self, self._res.release)

    # -- start-up ---------------------------------------------------------------------------

    def _place_workers(self) -> None:
        p = self.config.parallel
        gpu = self.config.model.device.startswith("cuda")
        bundle = {"GPU": 1} if gpu else {"CPU": 1}
        pg = self._res.pg = placement_group([bundle] * self.world_size, strategy=p.placement_strategy,
                                            name=f"devharness-{self.id}")
        self.placement_group_id = pg.id.hex()
        try:
            ray.get(pg.ready(), timeout=self.startup_timeout_s)
        except GetTimeoutError:
            raise RuntimeError(f"Ray could not place {self.world_size} workers ({bundle} each, {p.placement_strategy}) "
                               f"within {self.startup_timeout_s:.0f} s; free in the cluster: {ray.available_resources()}. "
                               "Add nodes or resources, or lower tp x pp") from None
        # The "loop" lane runs the step loop (shm) or the liveness sentinel (cgraph), leaving the default
        # lane free for control calls, even while a step hangs.
        actor_cls = ray.remote(concurrency_groups={"loop": 1})(RayWorker)
        tp = p.tensor_parallel_size
        for rank, bundle in enumerate(bundles_in_rank_order(pg)):
            self.actors.append(actor_cls.options(
                name=f"devharness-{self.id}-rank{rank}-tp{rank % tp}-pp{rank // tp}",
                num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
            ).remote(rank, rank % tp, rank // tp, ray_debugger=self.config.debug.enabled))
        self._res.actors = self.actors

    def _start_workers(self) -> None:
        p = self.config.parallel
        infos = self._get_all([a.node_info.remote() for a in self.actors], "start-up", self.startup_timeout_s)
        self.node_ids, self.node_ips, cpus, self.worker_pids = (list(col) for col in zip(*infos))
        self.driver_node = ray.get_runtime_context().get_node_id()
        if all(node == self.driver_node for node in self.node_ids):
            # Every rank on this machine: a file store in a private folder, the backends on loopback.
            rendezvous, self._res.rendezvous_folder = local_rendezvous()
            rank_rendezvous = [rendezvous] * self.world_size
        else:
            # Across machines: rank 0's store on its node's address, each rank's backend on its own node's.
            host = self.node_ips[0]
            port = self._get_all([self.actors[0].open_store.remote(host)], "start-up", self.startup_timeout_s,
                                 ranks=[0])[0]
            rendezvous = tcp_rendezvous(host, port)
            rank_rendezvous = [msgspec.structs.replace(rendezvous, bind_address=ip) for ip in self.node_ips]
        self.rendezvous = rendezvous
        refs = []
        for rank, actor in enumerate(self.actors):
            # Workers on one node share its cores: oversubscribed torch threads slow every rank down.
            threads = p.threads_per_worker or max(1, cpus[rank] // self.node_ids.count(self.node_ids[rank]))
            cfg = msgspec.structs.replace(self.config, parallel=msgspec.structs.replace(p, threads_per_worker=threads))
            refs.append(actor.init_worker.remote(cfg, self.source, self.max_model_len, rank_rendezvous[rank]))
        self._get_all(refs, "start-up", self.startup_timeout_s)
        # init_device joins the process group, so every rank must be inside it at once: one call to all.
        self.control(InitDevice(), timeout_s=self.startup_timeout_s)
        self.control(LoadModel(), timeout_s=self.startup_timeout_s)

    def _compile_graph(self) -> None:
        from ray.dag import DAGContext, InputNode, MultiOutputNode
        # Sentinels that fail only when an actor dies: after a graph error they tell which rank it was.
        self._res.liveness = [a.wait_until_killed.options(concurrency_group="loop").remote() for a in self.actors]
        with InputNode() as message:
            dag = MultiOutputNode([a.execute_model_bytes.bind(message) for a in self.actors])
        # The graph copies DAGContext.get_timeout when compiled; Ray's 10 s default would end a step
        # whose worker sits at a breakpoint.
        ctx = DAGContext.get_current()
        default_get_timeout = ctx.get_timeout
        ctx.get_timeout = self.step_timeout_s
        try:
            self._res.dag = dag.experimental_compile(_submit_timeout=self.step_timeout_s)
        finally:
            ctx.get_timeout = default_get_timeout

    def _start_loops(self) -> None:
        from devharness.distributed.message_queue import MessageQueue
        from devharness.distributed.shm_ring import ShmBroadcast
        # Decided by Ray node id, never by trying to attach: two Ray nodes on one machine share /dev/shm,
        # two real machines do not.
        local = [r for r in range(self.world_size) if self.node_ids[r] == self.driver_node]
        remote = [r for r in range(self.world_size) if r not in local]
        queue = self._res.queue = MessageQueue(local, remote, host=ray.util.get_node_ip_address(),
                                               send_timeout_s=self.step_timeout_s)
        ringed = [r for r in self.answering if r in local]
        handles = self._get_all([self.actors[r].create_response_ring.remote() for r in ringed], "start-up",
                                self.step_timeout_s, ranks=ringed)
        self._res.responses = {r: ShmBroadcast.attach(h, 0) for r, h in zip(ringed, handles)}
        self._res.liveness = [a.run_loop.options(concurrency_group="loop").remote(queue.handle(r),
                                                                                  r in self.answering)
                              for r, a in enumerate(self.actors)]
        deadline = time.monotonic() + self.startup_timeout_s
        while remote:
            try:
                queue.accept(_LIVENESS_POLL_S)
                break
            except TimeoutError as e:
                # A loop that failed before connecting would otherwise keep us here for the whole timeout.
                self._raise_if_dead("start-up", 0.0)
                if time.monotonic() > deadline:
                    raise WorkerError(f"start-up: {e} after {self.startup_timeout_s:.0f} s") from None

    # -- steps ------------------------------------------------------------------------------

    @property
    def supports_async_steps(self) -> bool:
        return self.mode == "shm"   # a compiled graph runs one execution at a time here

    def execute_model_async(self, so: SchedulerOutput) -> StepFuture:
        self._check_open("execute_model")
        if self._res.failed:
            raise WorkerError(f"the Ray workers failed earlier ({self._res.failed.splitlines()[0]}); start a new LLM")
        self._step = so.step
        # Encoded once here, read by every rank.
        message = encoder.encode(so)
        with self._marking_failure():
            if self.mode == "cgraph":
                return StepFuture.done(so.step, self._execute_cgraph(message))
            seq = self._send_step(message)

        def collect() -> ModelRunnerOutput:
            if self._res.failed:
                raise WorkerError(f"step {so.step}: the Ray workers failed earlier "
                                  f"({self._res.failed.splitlines()[0]})")
            self._step = so.step
            with self._marking_failure():
                return self._await_step(seq)
        return StepFuture(so.step, collect)

    def _execute_cgraph(self, message: bytes) -> ModelRunnerOutput:
        deadline = time.monotonic() + self.step_timeout_s
        results = []
        try:
            for ref in self._res.dag.execute(message):
                results.append(ref.get(timeout=max(0.0, deadline - time.monotonic())))
        except RayChannelTimeoutError:
            self._raise_if_dead(f"step {self._step}", 0.0)
            raise WorkerError(f"step {self._step}: no result from the compiled graph within "
                              f"{self.step_timeout_s:.0f} s; {hang_report(self.config.run_id, self.world_size, self._step)}") from None
        except RayError as e:
            self._raise_if_dead(f"step {self._step}", _DEATH_REPORT_S)
            # Results arrive in rank order, so a task error belongs to the first rank without a result.
            who = self._describe(len(results)) if isinstance(e, RayTaskError) else "a rank"
            raise WorkerError(f"step {self._step}: {who} failed in the compiled graph: {brief(e)}") from e
        out = output_decoder.decode(results[self.output_rank])
        return with_kv_alarms(out, [r for rank, r in enumerate(results) if rank != self.output_rank],
                              output_decoder.decode)

    def _send_step(self, message: bytes) -> int:
        """Write step call `message` on the queue; its seq."""
        self._seq += 1
        call = StepCall(self._seq, msgspec.Raw(message))
        what = f"step {self._step}"
        deadline = time.monotonic() + self.step_timeout_s

        def on_stall(e: TimeoutError) -> None:
            # A rank busy with the steps before this one (a message larger than the ring then streams at
            # its pace) or paused in a debugger slows the write down; a dead or hung one ends it.
            self._raise_if_dead(what, 0.0)
            if time.monotonic() >= deadline:
                raise WorkerError(f"{what}: the workers stopped reading step messages: {e}") from e
            # A rank that answers may be waiting for room on its answers' ring before it reads on (a TCP answer
            # waits in the socket's buffers).
            for rank in self._res.responses:
                with contextlib.suppress(TimeoutError):
                    while self._read_reply(rank, 0.0):
                        pass
        try:
            self._res.queue.write(encoder.encode(call), timeout_s=_STALL_CHECK_S, on_stall=on_stall)
        except OSError as e:  # a socket whose worker is gone, or that stopped reading for the step timeout
            self._raise_if_dead(what, _DEATH_REPORT_S)
            raise WorkerError(f"{what}: could not send the step message: {e}") from None
        return self._seq

    def _await_step(self, seq: int) -> ModelRunnerOutput:
        out = output_decoder.decode(self._await_reply(self.output_rank, seq).result)
        if len(self.answering) == 1:
            return out
        # The other ranks answer once their KV checksums of the step are checked (a nil where nothing was found).
        return with_kv_alarms(out, [self._await_reply(r, seq).result for r in self.answering[1:]],
                              output_decoder.decode)

    def _await_reply(self, rank: int, seq: int) -> Reply:
        """`rank`'s answer to step call `seq`. It answers in call order: answers to earlier calls read on the
        way (their futures not resolved yet) are kept for them."""
        deadline = time.monotonic() + self.step_timeout_s
        early = self._early[rank]
        while seq not in early:
            try:
                if self._read_reply(rank, _LIVENESS_POLL_S):
                    continue
            except TimeoutError:
                pass
            except ConnectionError:
                self._raise_if_dead(f"step {self._step}", _DEATH_REPORT_S)
                raise WorkerError(f"step {self._step}: {self._describe(rank)} closed its TCP "
                                  "control connection") from None
            self._raise_if_dead(f"step {self._step}", 0.0)
            if time.monotonic() > deadline:
                raise WorkerError(f"step {self._step}: no result from {self._describe(rank)} within "
                                  f"{self.step_timeout_s:.0f} s; {hang_report(self.config.run_id, self.world_size, self._step)}")
        return early.pop(seq)

    def _read_reply(self, rank: int, timeout_s: float) -> bool:
        """Keep `rank`'s next answer in self._early; False (or TimeoutError) if none came within timeout_s."""
        ring = self._res.responses.get(rank)
        data = ring.read(timeout_s) if ring is not None else self._res.queue.read_from(rank, timeout_s)
        if data is None:
            return False
        reply = reply_decoder.decode(data)
        self._early[rank][reply.seq] = reply
        return True

    def exposure(self) -> str | None:
        parts = []
        remote = [r for r, node in enumerate(self.node_ids) if node != self.driver_node]
        if self.rendezvous is not None and not self.rendezvous.local:
            store = self.rendezvous.store_address
            if not is_loopback(store[0]):
                parts.append(f"torch.distributed's store at {_host_port(*store)} (rank 0's: ranks on other nodes "
                             "join the process group there)")
            backend = "nccl" if self.config.model.device.startswith("cuda") else "gloo"
            ips = sorted({ip for ip in self.node_ips if not is_loopback(ip)})
            if ips:
                parts.append(f"{backend}'s ports on each rank's node address ({', '.join(ips)}: tensors between "
                             "ranks cross nodes there)")
        channel = self._res.queue.tcp.address if self._res.queue is not None and self._res.queue.tcp else None
        if channel is not None and not is_loopback(channel[0]):
            parts.append(f"the step channel at {_host_port(*channel)} (step messages to ranks "
                         f"{', '.join(map(str, remote))} on other nodes; a connection must show this run's token)")
        node_ip = ray.util.get_node_ip_address() if ray.is_initialized() else None
        if node_ip is not None and not is_loopback(node_ip):
            parts.append(f"Ray's own on {node_ip} and the cluster's other nodes (GCS, raylet, object manager, agents "
                         f"and every worker's gRPC server, this driver's too: Ray's nodes reach each other there; "
                         f"{_ray_auth()})")
        return "devharness: reachable from other machines: " + "; ".join(parts) if parts else None

    def control_paths(self) -> dict[int, str]:
        """How each rank receives step messages: "cgraph", "shm" or "tcp"."""
        if self.mode == "cgraph":
            return dict.fromkeys(range(self.world_size), "cgraph")
        return self._res.queue.paths()

    def _control(self, call: bytes, ranks: list[int], timeout_s: float | None, what: str) -> list[bytes]:
        self._check_open(what)
        try:
            return self._get_all([self.actors[r].control.remote(call) for r in ranks],
                                 what, timeout_s or self.step_timeout_s, ranks)
        except WorkerError as e:
            # A call that raised leaves the workers usable; one that found a rank dead does not.
            if self._res.liveness and ray.wait(self._res.liveness, timeout=0)[0]:
                self._res.failed = self._res.failed or str(e)
            raise

    def check_health(self) -> None:
        self._check_open("check_health")
        if self._res.failed:
            raise WorkerError(f"the Ray workers failed earlier: {self._res.failed.splitlines()[0]}")
        self._raise_if_dead("health check", 0.0)

    def restart_workers(self) -> None:
        # Ray itself stays up (this executor may have started it): a new set of actors, not a new cluster.
        started_ray, self._res.started_ray = self._res.started_ray, False
        self.shutdown(force=True)
        del self._finalizer   # _init_workers makes the new set's; until then calls are not refused as "shut down"
        try:
            super().restart_workers()   # shutdown again is a no-op
        except BaseException:
            self._res.started_ray = started_ray
            self._finalizer = weakref.finalize(self, self._res.release)
            self._finalizer()
            raise
        self._res.started_ray = started_ray

    def shutdown(self, force: bool = False) -> None:
        if not hasattr(self, "_finalizer"):   # mid-restart
            return
        if force and self._finalizer.alive:
            # A step holds the workers: EXIT would not be read. Kill first (see Resources.release).
            self._res.failed = self._res.failed or "shut down while a step was running"
        self._finalizer()

    def _check_open(self, what: str) -> None:
        if hasattr(self, "_finalizer") and not self._finalizer.alive:
            raise RuntimeError(f"{what}: the ray executor is shut down")

    # -- failures ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _marking_failure(self):
        """Remember the first failed step: the workers hold half-applied request state, so no later step
        may run on them, and shutdown skips the graceful path that waits on them."""
        try:
            yield
        except WorkerError as e:
            self._res.failed = self._res.failed or str(e)
            raise

    def _get_all(self, refs: list, what: str, timeout_s: float, ranks: list[int] | None = None) -> list:
        """ray.get of one call per rank; a failure becomes a WorkerError naming the rank."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        try:
            return ray.get(refs, timeout=timeout_s)
        except GetTimeoutError:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            late = [r for r, ref in zip(ranks, refs) if ref not in done]
            raise WorkerError(f"{what}: rank(s) {late} did not answer within {timeout_s:.0f} s") from None
        except RayError as e:
            if isinstance(e, RayActorError):
                self._raise_if_dead(what, _DEATH_REPORT_S)
            for rank, ref in zip(ranks, refs):
                try:
                    ray.get(ref, timeout=0)
                except GetTimeoutError:   # (a RayError too) not done yet: not the one that failed
                    continue
                except RayActorError as err:   # its actor is gone, though the liveness ref has not said so yet
                    raise WorkerDied(f"{self._describe(rank)} failed in {what}: {brief(err)}", rank=rank,
                                     cause=brief(err)) from err
                except RayError as err:
                    raise WorkerError(f"{self._describe(rank)} failed in {what}: {brief(err)}") from err
            if isinstance(e, RayActorError):
                raise WorkerDied(f"{what} failed: {brief(e)}", cause=brief(e)) from e
            raise WorkerError(f"{what} failed: {brief(e)}") from e

    def _raise_if_dead(self, what: str, wait_s: float) -> None:
        """Raise WorkerError naming a rank whose liveness ref has resolved: its actor died or its step loop
        failed. A dead actor is named before a peer that failed because it vanished mid-collective."""
        refs = self._res.liveness
        if not refs or not ray.wait(refs, num_returns=1, timeout=wait_s)[0]:
            return
        deadline = time.monotonic() + _DEATH_REPORT_S
        while True:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            causes = {refs.index(ref): error_of(ref) for ref in ready}
            dead = sorted(r for r, e in causes.items() if isinstance(e, RayActorError))
            # Ray reports a death within about a second; a peer's collective error may come first.
            if dead or len(ready) == len(refs) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        rank = dead[0] if dead else min(causes)
        cause = causes[rank]
        if cause is None:
            raise WorkerError(f"{self._describe(rank)}: its step loop ended during {what}")
        if dead:
            raise WorkerDied(f"{self._describe(rank)} died during {what}: {brief(cause)}", rank=rank,
                             cause=brief(cause)) from cause
        # A rank that failed in a collective (a timeout) is often the victim: say who never arrived.
        report = f" [{hang_report(self.config.run_id, self.world_size, self._step)}]"
        raise WorkerError(f"{self._describe(rank)} failed during {what}: {brief(cause)}{report}") from cause

    def _describe(self, rank: int) -> str:
        tp = self.config.parallel.tensor_parallel_size
        where = f", node {self.node_ips[rank]}, pid {self.worker_pids[rank]}" if self.worker_pids else ""
        return f"rank {rank} (tp {rank % tp}, pp {rank // tp}{where})"


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ray_auth() -> str:
    """Whether this Ray cluster asks for its token (Ray's token authentication)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
        return "the cluster's token authentication guards them" if is_token_auth_enabled() else \
            "the cluster has no token authentication (RAY_AUTH_MODE): only its network guards them"
    except Exception:   # another Ray version
        return "the cluster's own settings guard them"
