"""Pilot and snapshot tests of `devharness tui` against a fake client serving canned snapshots,
with the clock frozen so times in phase (and so the screenshots) never move."""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import msgspec
import pytest
from textual import events

from devharness.tui.app import DebugTUI, tui_main
from devharness.protocol.messages import DebugpyInfo, EngineStats, PausedInfo, Snapshot, StepRecord, WorkerState
from devharness.tui.client import Completion, HttpDebugClient, StreamUnsupported, follow
from devharness.tui.detail import DetailPane, StepTimeline, attach_config
from devharness.tui.widgets import WorkerCell

NOW = 1_764_400_100.0
STACK = 'Thread 0x7f (most recent call last):\n  File "worker.py", line 88, in execute_model\n    dist.all_reduce(x)'


def worker(rank: int, tp: int = 2, **kw) -> WorkerState:
    fields = dict(tp_rank=rank % tp, pp_rank=rank // tp, node_ip="10.0.0.7", pid=4240 + rank,
                  debugpy=DebugpyInfo(port=5678 + rank), step=57, phase="forward",
                  detail="layer 1 attention", phase_since=NOW - 0.05, last_step_ms=12.3,
                  num_reqs=8, num_tokens=8, kv_blocks_used=20 + 40 * rank, kv_blocks_total=512)
    return WorkerState(rank=rank, **{**fields, **kw})


def snapshot(step: int = 57, state: str = "running", workers=None, tokens_per_s: float = 410.0) -> Snapshot:
    workers = workers if workers is not None else [worker(r, step=step) for r in range(4)]
    return Snapshot(engine=EngineStats(step=step, state=state, num_running=8, num_waiting=2,
                                       tokens_per_s=tokens_per_s), workers=workers)


IDLE = snapshot(step=0, tokens_per_s=0.0, workers=[
    worker(r, step=0, phase="idle", detail=None, num_reqs=0, num_tokens=0, kv_blocks_used=0,
           last_step_ms=None) for r in range(4)])
PAUSED_AT_88 = PausedInfo(reason="breakpoint", file="/src/devharness/model/llama.py", line=88, since=NOW - 31)
HUNG = snapshot(state="paused", workers=[
    worker(0, phase="collective", detail="layer 3 all_reduce", phase_since=NOW - 30),
    worker(1, phase="paused", detail="layer 3", paused=PAUSED_AT_88,
           debugpy=DebugpyInfo(port=5679, client_connected=True)),
    worker(2, phase="recv", detail="hidden states", phase_since=NOW - 29),
    worker(3, phase="recv", detail="hidden states", phase_since=NOW - 4)])
BUSY = [snapshot(step, tokens_per_s=380.0 + 9 * (step % 7), workers=[
    worker(0, step=step, detail=f"layer {step % 4} attention", num_tokens=64 + step % 5),
    worker(1, step=step, phase="collective", detail=f"layer {step % 4} all_reduce", phase_since=NOW - 0.3),
    worker(2, step=step - 1, phase="sample", detail=None, kv_blocks_used=300, last_step_ms=14.8),
    worker(3, step=step - 1, phase="send", detail="logits to driver", phase_since=NOW - 2.5,
           kv_blocks_used=480, debugpy=DebugpyInfo(port=5681, client_connected=True))])
    for step in range(50, 58)]
DEAD = snapshot(workers=[worker(r) for r in range(3)] +
                [worker(3, phase="dead", detail="process 4243 is gone", alive=False)])
HISTORY = [StepRecord(step=s, phases={"prepare": 1.0, "forward": 6.0 + s % 3, "collective": 2.5,
                                      "sample": 0.8}) for s in range(40, 58)]

# Four ranks (tp 2 x pp 2) over steps 1..4 of 10 ms each, 2 ms apart: stage 1 starts 5 ms after stage 0 and
# waits 3 ms of each step on its receive; rank 1 is the named straggler.
TIMED_HISTORY = {r: [StepRecord(step=s, phases={"prepare": 1.0, "recv": 3.0 * (r // 2), "forward": 6.0 - 3.0 * (r // 2),
                                               "collective": 2.0, "sample": 1.0},
                                total_ms=10.0, started_at=NOW + 0.012 * s + 0.005 * (r // 2)) for s in range(1, 5)]
                 for r in range(4)}
TIMELINE_ANSWERS = {"steps": 4, "stages": [{"pp_rank": 0, "busy_fraction": 0.7, "bubble_fraction": 0.3},
                                           {"pp_rank": 1, "busy_fraction": 0.5, "bubble_fraction": 0.5}],
                    "collectives": [], "straggler": {"rank": 1, "layer": 0, "site": "attention all_reduce",
                                                     "group": "tp0", "late_ms_p50": 12.5},
                    "step_breakdown": {}}


class FakeClient:
    """A DebugClient with canned answers; records every control call in `calls`."""

    base_url = "http://fake:8000"

    def __init__(self, first: Snapshot | None = IDLE, history=HISTORY, logs=None) -> None:
        self.current, self.up = first, first is not None
        self._history, self._logs = history, logs
        self.ledgers: dict | None = None   # rank -> Ledger; None: no collectives route
        self._updates: asyncio.Queue[Snapshot | None] = asyncio.Queue()
        self.calls: list[tuple] = []
        self.generating = asyncio.Event()   # complete() answers once this is set
        self.generating.set()

    def push(self, snap: Snapshot) -> None:
        self._updates.put_nowait(snap)

    def go_away(self) -> None:
        self.up = False
        self._updates.put_nowait(None)

    async def snapshot(self) -> Snapshot:
        if not self.up:
            raise httpx.ConnectError("connection refused")
        return self.current

    async def stream(self):
        while (snap := await self._updates.get()) is not None:
            self.current = snap
            yield snap
        raise httpx.ReadError("server went away")

    async def pause(self): self.calls.append(("pause",))
    async def resume(self): self.calls.append(("resume",))
    async def step(self, n=1): self.calls.append(("step", n))

    async def arm_break(self, rank=None, step=None, layer=None):
        self.calls.append(("break", {k: v for k, v in dict(rank=rank, step=step, layer=layer).items()
                                     if v is not None}))

    async def stack(self, rank): self.calls.append(("stack", rank)); return STACK
    async def bundle(self): self.calls.append(("bundle",)); return "/tmp/devharness-bundles/run1-step57-requested"

    async def release(self, rank=None):
        self.calls.append(("release", rank))
        return [1] if rank in (None, 1) else []
    async def history(self, rank): return self._history
    async def logs(self, rank): return self._logs
    async def collectives(self, rank, last=64): return self.ledgers.get(rank) if self.ledgers else None

    async def complete(self, prompt, max_tokens):
        self.calls.append(("complete", prompt, max_tokens))
        await self.generating.wait()
        return Completion(text=" Paris, the city of light.", num_tokens=16)

    async def kv(self):
        self.calls.append(("kv",))
        return KV_MAP

    async def requests(self):
        self.calls.append(("requests",))
        return REQUESTS[0]

    async def request_story(self, request_id):
        return REQUESTS[1].get(request_id)

    async def timeline(self, steps=None):
        self.calls.append(("timeline", steps))
        return TIMELINE_ANSWERS

    async def aclose(self): pass


def kv_map():
    """A block manager's map after a small run: two requests sharing a cached two-block prefix (one of them
    preempted once and back), a third waiting, cached free blocks left by a finished one."""
    from devharness.engine.kv_cache import BlockManager
    from devharness.engine.request import Request, RequestStatus
    from devharness.sampling_params import SamplingParams
    bm = BlockManager(num_blocks=72, block_size=4, enable_prefix_caching=True)
    mk = lambda rid, toks: Request(rid, toks, SamplingParams(), 0, (), 10_000)
    shared = list(range(8))
    reqs = {}
    for step, (rid, toks) in enumerate([("cmpl-old", shared + [90, 91, 92, 93]), ("cmpl-a", shared + list(range(20, 30))),
                                        ("cmpl-b", shared + list(range(40, 61)))], start=50):
        bm.step = step
        r = reqs[rid] = mk(rid, toks)
        found = bm.lookup(r)
        r.num_cached_tokens = len(found.blocks) * 4
        bm.allocate_slots(r, r.num_tokens - r.num_cached_tokens, found.blocks)
        bm.record_lookup(r, found)
        r.num_computed_tokens, r.status = r.num_tokens, RequestStatus.RUNNING
        bm.cache_full_blocks(r)
        if rid == "cmpl-old":
            bm.free(r)
    bm.step = 56
    bm.free(reqs["cmpl-b"], kind="preempt")
    bm.step = 57
    b = reqs["cmpl-b"]
    found = bm.lookup(b)
    bm.allocate_slots(b, b.num_tokens - len(found.blocks) * 4 - 3, found.blocks)
    bm.record_lookup(b, found)
    b.num_computed_tokens = b.num_tokens - 3
    waiting = mk("cmpl-c", list(range(100, 140)))
    return bm.snapshot(57, [(reqs["cmpl-a"], "running"), (b, "running"), (waiting, "waiting")], 1, True)


KV_MAP = kv_map()


def requests_view():
    """A scheduler's stories after a small run (a stand-in for the workers samples a token wherever a request's
    prompt is done): max_num_seqs holds some requests back and the planted sched-strand skips one until the stall
    detector names it. Times are pinned, so that the screenshots never move."""
    from devharness.config import SchedulerConfig
    from devharness.debug import faults, sched_faults
    from devharness.engine.request import Request
    from devharness.engine.scheduler import Scheduler
    from devharness.protocol.messages import ModelRunnerOutput
    from devharness.sampling_params import SamplingParams
    sched = Scheduler(SchedulerConfig(block_size=4, enable_prefix_caching=False, max_num_seqs=2, stall_steps=3), 64)
    sched_faults.install(faults.parse("sched-strand:step=3"), sched)
    for step in range(9):
        if step < 7:
            sched.add_request(Request(f"cmpl-{step}", list(range(10 + step, 20 + 2 * step)),
                                      SamplingParams(max_tokens=3 + 2 * step, ignore_eos=True), 0, (), 1000))
        so = sched.schedule()
        done = [rid for rid, n in so.num_scheduled_tokens.items()
                if (r := sched.requests.get(rid)) is not None and r.num_computed_tokens + n >= r.num_tokens]
        sched.update_from_output(so, ModelRunnerOutput(done, [7] * len(done)))
    pin = lambda r, i: msgspec.structs.replace(r, arrival_time=NOW - 9.0 + i, queued_s=0.25 * (i % 3))  # noqa: E731
    snap = sched.stories.snapshot(sched.step_count, False)
    order = {r.request_id: i for i, r in enumerate(sorted(snap.requests, key=lambda r: r.request_id))}
    snap = msgspec.structs.replace(snap, time=NOW, stalls=[msgspec.structs.replace(s, time=NOW) for s in snap.stalls],
                                   requests=[pin(r, order[r.request_id]) for r in snap.requests])
    return snap, {rid: pin(sched.stories.story(rid, False), i) for rid, i in order.items()}


REQUESTS = requests_view()


class Clock:
    """Frozen unless a test moves it."""

    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_app(client: FakeClient, retry_s: float = 0.01, clock=None, tick_s: float = 3600) -> DebugTUI:
    # The tick is off unless a test wants it: a real-time timer sampling a test clock races.
    return DebugTUI(client, clock=clock or Clock(), retry_s=retry_s, tick_s=tick_s)


async def until(pilot, condition, timeout_s: float = 30.0) -> None:
    """Waits for `condition` with a generous deadline in seconds, not a count of polls (a slow machine polls less)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition never became true")
        await pilot.pause(0.01)


def cell_text(app: DebugTUI, rank: int) -> str:
    return app.query_one(f"#rank-{rank}", WorkerCell).render().plain


def text_of(app: DebugTUI, selector: str) -> str:
    return str(app.query_one(selector).render())


# -- Pilot: views ---------------------------------------------------------------------------

async def test_idle_view_lays_out_the_topology_and_selects_rank_0():
    app = make_app(FakeClient(IDLE))
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.focused is not None)
        await pilot.pause()
        cells = list(app.query(WorkerCell))
        assert [c.state.rank for c in cells] == [0, 1, 2, 3]
        assert [(c.region.x > cells[0].region.x, c.region.y > cells[0].region.y) for c in cells] == \
            [(False, False), (True, False), (False, True), (True, True)]   # tp across, pp down
        assert app.focused is cells[0] and app.selected_rank == 0
        assert "idle" in cell_text(app, 0) and "debugpy :5678 not attached" in cell_text(app, 0)
        assert not app.query_one("#hang").display and not app.query_one("#banner").display


async def test_busy_steps_advance_in_place():
    client = FakeClient(snapshot(57))
    app = make_app(client)
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.focused is not None)
        first = app.query_one("#rank-3", WorkerCell)
        for step in (58, 59, 60):
            client.push(snapshot(step, tokens_per_s=400.0 + step))
        await until(pilot, lambda: "step 60" in cell_text(app, 3))
        assert app.query_one("#rank-3", WorkerCell) is first   # updated, not rebuilt
        assert "step 60" in text_of(app, "#engine-text") and "460 tok/s" in text_of(app, "#engine-text")
        timeline = app.query_one(StepTimeline).render().plain
        assert "57" in timeline and "ms" in timeline and "forward" in timeline


async def test_paused_worker_and_the_hang_view():
    app = make_app(FakeClient(HUNG))
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.query_one("#hang").display)
        hang = text_of(app, "#hang")
        assert "rank 0 waits for rank 1 (paused at llama.py:88)" in hang
        assert "root cause: rank 1 (paused at llama.py:88)" in hang
        assert "rank 3 waits" not in hang or "4.0 s" in hang
        assert "breakpoint at llama.py:88" in cell_text(app, 1) and "attached" in cell_text(app, 1)
        assert app.query_one("#rank-0").has_class("-stuck") and app.query_one("#rank-3").has_class("-slow")
        assert "PAUSED" in text_of(app, "#engine-text")


def _ledger(rank: int, group: str, desc: str, ranks: list[int], seqs: range):
    from devharness.protocol.messages import Ledger, LedgerEntry, LedgerGroup
    entries = [LedgerEntry(record_id=q - 1, group=group, op="all_reduce", collective_seq=q, p2p_seq=0, peer=None,
                           step=57, layer=3, site="mlp all_reduce", in_shape=[8, 576], in_dtype="float32",
                           out_shape=[8, 576], out_dtype="float32", state="started" if q == seqs[-1] else "completed",
                           created_ns=1) for q in seqs]
    return Ledger(rank=rank, groups=[LedgerGroup(group, desc, ranks)], entries=entries, count=len(entries))


async def test_the_hang_view_shows_how_far_each_rank_got_and_the_detail_its_last_collectives():
    client = FakeClient(HUNG)
    client.ledgers = {0: _ledger(0, "1", "tp0", [0, 1], range(1, 13)), 1: _ledger(1, "1", "tp0", [0, 1], range(1, 12)),
                      2: _ledger(2, "2", "tp1", [2, 3], range(1, 10)), 3: _ledger(3, "2", "tp1", [2, 3], range(1, 10))}
    app = make_app(client)
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: "reached:" in text_of(app, "#hang"))
        assert "reached: tp0: rank 0 #12, rank 1 #11 · tp1: rank 2 #9, rank 3 #9" in text_of(app, "#hang")
        await until(pilot, lambda: "12 ops in all" in text_of(app, "#collectives-text"))
        last = text_of(app, "#collectives-text").splitlines()[-1]
        assert last.split() == ["tp0", "#12", "step", "57", "all_reduce", "8x576", "float32", "layer", "3", "mlp",
                                "all_reduce", "started"], last


async def test_every_paused_rank_shows_at_once():
    """The "attach all ranks" case: ranks 0 and 1 both stopped at one breakpoint, stage 1 waiting on them."""
    at_58 = PausedInfo(reason="breakpoint", file="/src/devharness/model/attention.py", line=58, since=NOW - 12)
    both = snapshot(state="running", workers=[
        worker(r, phase="paused", detail="layer 0 attention", paused=at_58,
               debugpy=DebugpyInfo(port=5678 + r, client_connected=True)) for r in (0, 1)] + [
        worker(r, phase="recv", detail="hidden states", phase_since=NOW - 11) for r in (2, 3)])
    app = make_app(FakeClient(both))
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.query_one("#hang").display)
        for rank in (0, 1):
            assert "breakpoint at attention.py:58" in cell_text(app, rank) and "attached" in cell_text(app, rank)
            assert app.query_one(f"#rank-{rank}").has_class("-paused")
        assert not app.query_one("#rank-2").has_class("-paused")
        hang = text_of(app, "#hang")
        assert "root cause: rank 0 (paused at attention.py:58), rank 1 (paused at attention.py:58)" in hang


async def test_bundles_and_the_detectors_hang_event():
    """d asks for a bundle and says where it went; a bundle the server wrote on its own (a hang) is told
    once, one that predates the TUI is not; the detector's event heads the hang view."""
    old = msgspec.structs.replace(HUNG.engine, bundle="/b/old")
    client = FakeClient(msgspec.structs.replace(HUNG, engine=old))
    app = make_app(client)
    notes = lambda: [str(n.message) for n in app._notifications]  # noqa: E731
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.query_one("#hang").display)
        await pilot.press("d")
        await until(pilot, lambda: "bundle written: /tmp/devharness-bundles/run1-step57-requested" in notes())
        assert client.calls == [("bundle",)] and not any("/b/old" in n for n in notes())
        event = "hang in step 57: rank(s) 0 have waited 5.1 s in layer 3 all_reduce for rank 1 (paused)"
        client.push(msgspec.structs.replace(HUNG, engine=msgspec.structs.replace(old, hang=event, bundle="/b/hang")))
        await until(pilot, lambda: "bundle written: /b/hang" in notes())
        assert text_of(app, "#hang").startswith("detected: " + event)
        client.push(msgspec.structs.replace(HUNG, engine=msgspec.structs.replace(old, hang=event, bundle="/b/hang")))
        await pilot.pause()
        assert sum("/b/hang" in n for n in notes()) == 1


async def test_a_stall_shows_in_the_hang_view_while_it_holds():
    """No rank waits for another, yet a request the scheduler keeps passing over is named in the hang view (the
    engine's stats carry the stalls that still hold) until it goes on."""
    stall = "request cmpl-7 passed-over: passed over 32 steps in a row (steps 26..57) although no reason held it"
    client = FakeClient(snapshot(57))
    app = make_app(client)
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.focused is not None)
        assert not app.query_one("#hang").display
        client.push(msgspec.structs.replace(snapshot(58), engine=msgspec.structs.replace(
            snapshot(58).engine, stalls=[stall + " (step 57)"])))
        await until(pilot, lambda: app.query_one("#hang").display)
        assert text_of(app, "#hang") == f"stall: {stall} (step 57)"
        client.push(snapshot(59))
        await until(pilot, lambda: not app.query_one("#hang").display)


async def test_time_in_phase_counts_on_while_the_server_is_silent():
    clock = Clock()
    app = make_app(FakeClient(HUNG), clock=clock, tick_s=0.02)
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: "30 s" in cell_text(app, 0))
        clock.t += 100
        await until(pilot, lambda: "2 min 10 s" in cell_text(app, 0))
        assert "2 min 10 s rank 0 waits for rank 1" in text_of(app, "#hang")


async def test_dead_worker_keeps_its_last_state():
    app = make_app(FakeClient(DEAD))
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.query("#rank-3"))
        assert app.query_one("#rank-3").has_class("-dead")
        assert "dead" in cell_text(app, 3) and "process 4243 is gone" in cell_text(app, 3)


async def test_disconnect_shows_banner_and_reconnects():
    client = FakeClient(snapshot(57))
    app = make_app(client)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.focused is not None)
        client.go_away()
        await until(pilot, lambda: app.query_one("#banner").display)
        assert "disconnected from http://fake:8000" in text_of(app, "#banner")
        assert app.default_screen.has_class("-disconnected") and "step 57" in cell_text(app, 0)
        client.up, client.current = True, snapshot(61)
        await until(pilot, lambda: not app.query_one("#banner").display)
        await until(pilot, lambda: "step 61" in cell_text(app, 0))


async def test_narrow_view_stacks_detail_under_the_grid():
    app = make_app(FakeClient(snapshot(57)))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.focused is not None)
        assert app.screen.has_class("-narrow")
        assert app.query_one(DetailPane).region.y >= app.query_one("#rank-2").region.bottom


# -- Pilot: keys ----------------------------------------------------------------------------

async def test_keys_call_the_client():
    client = FakeClient(snapshot(57))
    app = make_app(client)
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.focused is not None)
        await pilot.press("p")
        await until(pilot, lambda: client.calls == [("pause",)])
        await pilot.press("p", "s")
        await until(pilot, lambda: client.calls == [("pause",), ("resume",), ("step", 1)])
        await pilot.press("right", "b")
        await until(pilot, lambda: len(client.calls) == 4)
        assert app.selected_rank == 1 and client.calls[-1] == ("break", {"rank": 1})
        await pilot.press("B", "tab", "3", "enter")
        await until(pilot, lambda: len(client.calls) == 5)
        assert client.calls[-1] == ("break", {"rank": 1, "layer": 3})
        await pilot.press("t")
        await until(pilot, lambda: "dist.all_reduce" in text_of(app, "#stack-text"))
        assert client.calls[5:] == [("stack", 1)]


async def test_pause_shows_at_once_and_a_stale_running_snapshot_does_not_undo_it():
    class SlowPause(FakeClient):
        async def pause(self):
            self.calls.append(("pause",))
            await answered.wait()

    answered = asyncio.Event()
    client = SlowPause(snapshot(57))
    app = make_app(client)
    state = lambda: text_of(app, "#engine-text").split("step")[0]  # noqa: E731
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.focused is not None)
        await pilot.press("p")
        assert "PAUSED" in state()
        client.push(snapshot(58))                      # sent before the server took the pause
        await until(pilot, lambda: "step 58" in text_of(app, "#engine-text"))
        assert "PAUSED" in state()
        answered.set()                                 # the server has answered: its snapshots count again
        await until(pilot, lambda: client.calls == [("pause",)] and app._pending_state is None)
        client.push(snapshot(59))                      # resumed from elsewhere (another TUI, curl)
        await until(pilot, lambda: "running" in state() and "step 59" in text_of(app, "#engine-text"))
        await pilot.press("p")                         # so p pauses again, not resume
        await until(pilot, lambda: len(client.calls) == 2)
        assert client.calls == [("pause",), ("pause",)], client.calls


async def test_release_keys_let_the_selected_rank_or_every_rank_go_on():
    client = FakeClient(snapshot(57))
    app = make_app(client)
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.focused is not None)
        await pilot.press("right", "r")
        await until(pilot, lambda: client.calls == [("release", 1)])
        await until(pilot, lambda: any("released rank 1" in str(n.message) for n in app._notifications))
        await pilot.press("left", "r")
        await until(pilot, lambda: client.calls[-1] == ("release", 0))
        await until(pilot, lambda: any("rank 0: nothing to release" in str(n.message) for n in app._notifications))
        await pilot.press("R")
        await until(pilot, lambda: client.calls[-1] == ("release", None))


async def test_keys_typed_in_one_go_act_on_the_rank_the_arrows_reached():
    """A terminal delivers "right b" (or a paste) in one read: both keys are queued before focus
    moves, so the break must go to the rank the arrow selected, not the one focused before."""
    client = FakeClient(snapshot(57))
    app = make_app(client)
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.focused is not None)
        for key in ("down", "right", "b"):
            app.post_message(events.Key(key, key if len(key) == 1 else None))
        await until(pilot, lambda: client.calls)
        assert client.calls == [("break", {"rank": 3})] and app.selected_rank == 3
        await until(pilot, lambda: app.focused is app.query_one("#rank-3"))


async def test_a_slow_detail_load_is_not_restarted_by_the_tick():
    """On a slow server a load outlasts the tick. A new selection may cancel a load, but the
    tick must then wait for the new one, or it restarts it on every step and nothing arrives."""
    class SlowHistory(FakeClient):
        started = 0

        async def history(self, rank):
            self.started += 1
            await asyncio.sleep(0.2)
            return HISTORY

    client = SlowHistory(snapshot(57))
    app = make_app(client)
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.focused is not None and client.started == 1)
        app.post_message(events.Key("right", None))   # a new selection: its load cancels the first
        await until(pilot, lambda: client.started == 2)
        await pilot.pause(0.02)      # the cancelled load winds down
        client.push(snapshot(58))
        await until(pilot, lambda: app.snapshot.engine.step == 58)
        app._tick()                  # the engine stepped while the second load runs
        await until(pilot, lambda: app.query_one(StepTimeline).steps)
        assert client.started == 2


async def test_selection_by_arrows_and_click_updates_the_detail_pane():
    app = make_app(FakeClient(snapshot(57)))
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.focused is not None)
        await pilot.press("down")
        assert app.selected_rank == 2
        await pilot.click("#rank-3")
        assert app.selected_rank == 3 and "rank 3 · tp 1 · pp 1" in text_of(app, "#detail-title")
        attach = json.loads(text_of(app, "#attach-text").split("\n", 2)[2])
        assert attach["connect"] == {"host": "127.0.0.1", "port": 5681}


async def test_test_prompt_reports_its_answer_and_help_opens():
    client = FakeClient(snapshot(57))
    app = make_app(client)
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: app.focused is not None)
        client.generating.clear()
        await pilot.press("g")
        await until(pilot, lambda: "in flight" in text_of(app, "#trace"))
        assert text_of(app, "#trace").endswith("pp0 · → pp1 ·")
        stage_busy = lambda pp: [worker(r, phase="forward" if r // 2 == pp else "idle",   # noqa: E731
                                        num_reqs=1 if r // 2 == pp else 0) for r in range(4)]
        client.push(snapshot(58, workers=stage_busy(0)))
        await until(pilot, lambda: text_of(app, "#trace").endswith("pp0 ● forward → pp1 ·"))
        client.push(snapshot(59, workers=stage_busy(1)))
        await until(pilot, lambda: text_of(app, "#trace").endswith("pp0 ✓ → pp1 ● forward"))
        client.generating.set()
        await until(pilot, lambda: "16 tokens" in text_of(app, "#trace"))
        assert client.calls == [("complete", "The capital of France is", 16)]
        assert text_of(app, "#trace").endswith("pp0 ✓ → pp1 ✓")
        await pilot.press("question_mark")
        assert app.screen.query_one("#help-text")
        await pilot.press("escape")
        assert not app.screen.query("#help-text")


# -- the HTTP client against the route contract -----------------------------------------------

async def test_http_client_speaks_the_debug_routes():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path, json.loads(request.content or b"null")))
        path = request.url.path
        if path == "/debug/workers":
            return httpx.Response(200, content=b'{"engine": {"step": 3, "state": "paused", "x": 1},'
                                               b' "workers": [{"rank": 0, "phase": "idle", "new": 2}]}')
        if path == "/debug/stream":
            return httpx.Response(200, content=b': hi\n\ndata: {"engine": {"step": 4}}\n\ndata: {"engine":\n'
                                               b'data: {"step": 5}}\n\n')
        if path == "/debug/workers/0/history":   # msgspec array_like records (the older StepRecord)
            return httpx.Response(200, json={"rank": 0, "steps": [[7, {"forward": 2.0}, 2.5, 1]]})
        if path == "/debug/workers/1/history":
            return httpx.Response(200, json={"rank": 1, "steps": [{"step": 7, "phases": {"forward": 2.0}}]})
        if path == "/debug/workers/1/stack":
            return httpx.Response(200, json={"rank": 1, "stacks": STACK})
        if path.endswith("/logs"):
            return httpx.Response(404, json={"detail": "Not Found"})
        if path == "/debug/release":
            return httpx.Response(200, json={"released": [1], "attached": [0]})
        return httpx.Response(200, json={})

    client = HttpDebugClient("http://x:1/", transport=httpx.MockTransport(handler))
    assert (await client.snapshot()).engine.state == "paused"
    assert [s.engine.step async for s in client.stream()] == [4, 5]
    await client.pause(), await client.resume(), await client.step(1)
    await client.arm_break(rank=1), await client.arm_break(rank=0, step=42, layer=3)
    assert await client.stack(1) == STACK and await client.logs(1) is None
    assert await client.history(0) == [StepRecord(7, {"forward": 2.0}, 2.5, 1)]
    assert await client.history(1) == [StepRecord(7, {"forward": 2.0})]
    assert seen[2:7] == [("POST", "/debug/engine/pause", None), ("POST", "/debug/engine/resume", None),
                         ("POST", "/debug/engine/step", {"n": 1}), ("POST", "/debug/break", {"rank": 1}),
                         ("POST", "/debug/break", {"rank": 0, "step": 42, "layer": 3})]
    assert await client.release() == [1] and await client.release(1) == [1]
    assert seen[-2:] == [("POST", "/debug/release", {}), ("POST", "/debug/release", {"rank": 1})]
    await client.aclose()


async def test_follow_backs_off_then_polls_a_server_without_a_stream():
    class Stop(Exception):
        pass

    class Flaky(FakeClient):
        failures = 3

        async def snapshot(self):
            self.failures -= 1
            if self.failures >= 0:
                raise httpx.ConnectError("connection refused")
            return IDLE

        async def stream(self):
            raise StreamUnsupported("GET /debug/stream: 404")
            yield

    posted, sleeps = [], []

    async def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 5:
            raise Stop

    with pytest.raises(Stop):
        await follow(Flaky(), posted.append, retry_s=0.5, poll_s=0.25, sleep=sleep)
    assert sleeps == [0.5, 1.0, 2.0, 0.25, 0.25]
    assert [(type(m).__name__, getattr(m, "connected", None)) for m in posted] == \
        [("ConnectionChanged", False)] * 3 + [("ConnectionChanged", True)] + [("SnapshotReceived", None)] * 2
    assert [m.retry_in_s for m in posted[:3]] == [0.5, 1.0, 2.0]


def test_tui_main_rejects_a_url_without_scheme():
    with pytest.raises(ValueError, match="--url expects http://HOST:PORT"):
        tui_main(argparse.Namespace(url="127.0.0.1:8000"))


def test_attach_config_is_a_vscode_attach_configuration():
    text = attach_config(worker(1, source_root="/opt/devharness"))
    assert "ssh -N -L 5679:127.0.0.1:5679 10.0.0.7" in text
    config = json.loads(text.split("\n", 2)[2])
    assert config["request"] == "attach" and config["type"] == "debugpy"
    assert config["pathMappings"] == [{"localRoot": "${workspaceFolder}", "remoteRoot": "/opt/devharness"}]


# -- snapshots ------------------------------------------------------------------------------

async def _settled(pilot) -> None:
    app = pilot.app
    await until(pilot, lambda: app.focused is not None and app.query_one(StepTimeline).steps)
    await pilot.pause()


@pytest.mark.parametrize("size", [(80, 24), (200, 50)], ids=["80x24", "200x50"])
def test_snapshot_hung(snap_compare, size):
    """tp=2, pp=2: rank 1 at a breakpoint, rank 0 in all_reduce for 30 s, stage 1 in recv."""
    assert snap_compare(make_app(FakeClient(HUNG)), terminal_size=size, run_before=_settled)


@pytest.mark.parametrize("size", [(80, 24), (200, 50)], ids=["80x24", "200x50"])
def test_snapshot_busy(snap_compare, size):
    """Eight steps half a second apart fill the sparkline; stage 1 is a step behind, rank 3
    slow in send, its KV nearly full."""
    client, clock = FakeClient(BUSY[0]), Clock(NOW - 0.5 * (len(BUSY) - 1))

    async def run_before(pilot):
        for snap in BUSY[1:]:
            clock.t += 0.5
            client.push(snap)
            await until(pilot, lambda: f"step {snap.engine.step}" in text_of(pilot.app, "#engine-text"))
        await _settled(pilot)

    assert snap_compare(make_app(client, clock=clock), terminal_size=size, run_before=run_before)


def test_snapshot_disconnected_with_dead_worker(snap_compare):
    """The server went away after reporting rank 3 dead; the last snapshot stays, dimmed."""
    client = FakeClient(DEAD)

    async def run_before(pilot):
        await _settled(pilot)
        client.go_away()
        await until(pilot, lambda: pilot.app.query_one("#banner").display)

    assert snap_compare(make_app(client, retry_s=60), terminal_size=(120, 30), run_before=run_before)


# -- the KV view ---------------------------------------------------------------------------------

async def test_the_kv_view_shows_the_map_tables_and_events_of_a_paused_engine():
    from devharness.tui.kv import BlockMap, KvScreen
    client = FakeClient(HUNG)   # paused
    app = make_app(client)
    async with app.run_test(size=(120, 40)) as pilot:
        await _settled(pilot)
        await pilot.press("k")
        await until(pilot, lambda: isinstance(app.screen, KvScreen) and app.screen.snap is not None)
        screen = app.screen
        assert str(screen.query_one("#kv-summary").render()).startswith(
            f"KV cache at step 57: 72 blocks of 4 tokens; {KV_MAP.num_used} used")
        requests = screen.request_rows.plain
        a_blocks = next(r.blocks for r in KV_MAP.requests if r.request == "cmpl-a")
        assert "> A cmpl-a" in requests and f"table: {a_blocks[0]}@g" in requests
        shown = screen.query_one(BlockMap).render().plain.replace(" ", "")
        assert shown.count("A") == len(set(a_blocks) - {0, 1})   # blocks 0 and 1 are the shared prefix
        assert "*" in shown and "c" in shown
        events = screen.event_log.plain
        assert "    56 preempt  cmpl-b" in events
        assert "cmpl-a     [0, 1] 2 of 4 full block(s) hit; block 2 missed: not in the cache" in events
        await pilot.press("n")
        assert "> B cmpl-b" in screen.request_rows.plain
        await pilot.press("escape")
        assert not isinstance(app.screen, KvScreen)
    assert ("kv",) in client.calls


@pytest.mark.parametrize("size", [(80, 24), (200, 50)], ids=["80x24", "200x50"])
def test_snapshot_kv_view(snap_compare, size):
    """The KV view of a paused engine: two running requests sharing a cached prefix, one waiting."""
    async def run_before(pilot):
        await _settled(pilot)
        await pilot.press("k")
        await until(pilot, lambda: getattr(pilot.app.screen, "snap", None) is not None)
        await pilot.pause()

    assert snap_compare(make_app(FakeClient(HUNG)), terminal_size=size, run_before=run_before)


def _late_stage_ledgers(late_rank: int | None) -> dict:
    """Stage 1's ranks (2, 3, group tp1) over 20 steps, `late_rank` 30 ms late at layer 1's attention all-reduce."""
    from devharness.protocol.messages import Ledger, LedgerGroup
    from tests.diagnostics.test_timeline import tp_ledgers
    made = tp_ledgers(20, late=None if late_rank is None else (late_rank - 2, 3, 30.0))
    group = LedgerGroup("2", "tp1", [2, 3])
    return {r + 2: Ledger(rank=r + 2, groups=[group], entries=[msgspec.structs.replace(e, group="2")
                                                                for e in led.entries]) for r, led in made.items()}


@pytest.mark.parametrize("late_rank", [3, None])
async def test_the_hang_view_says_when_a_rank_not_hung_is_the_straggler(late_rank):
    client = FakeClient(HUNG)   # rank 1 paused holds everyone up; rank 3, if late, is late every step, not hung
    client.ledgers = _late_stage_ledgers(late_rank)
    app = make_app(client)
    async with app.run_test(size=(200, 50)) as pilot:
        await until(pilot, lambda: "reached:" in text_of(app, "#hang"))
        hang = text_of(app, "#hang")
        if late_rank is None:
            assert "straggler" not in hang, hang
        else:
            assert "straggler: rank 3 is not hung but the straggler: late at layer 1 attention all_reduce (tp1) by " \
                   "30." in " ".join(hang.split()), hang


# -- the requests view ---------------------------------------------------------------------------

async def test_the_requests_view_lists_by_age_with_reasons_and_tells_the_selected_ones_story():
    from devharness.tui.requests import RequestsScreen
    snap, stories = REQUESTS
    stall, = snap.stalls
    client = FakeClient(snapshot(57))
    app = make_app(client)
    async with app.run_test(size=(160, 40)) as pilot:
        await _settled(pilot)
        await pilot.press("w")
        await until(pilot, lambda: isinstance(app.screen, RequestsScreen) and app.screen.story is not None)
        screen = app.screen
        rows = screen.request_rows.plain.splitlines()[1:]
        live = sorted((r for r in snap.requests if r.state in ("waiting", "preempted", "running")),
                      key=lambda r: r.arrival_time)
        # Oldest first, the live ones before the finished; each waiting row says why, as the server does.
        assert [row[2:].split()[0] for row in rows][:len(live)] == [r.request_id for r in live]
        for r in live:
            row = next(x for x in rows if x[2:].startswith(r.request_id + " "))
            assert r.state in row and (r.waiting_reason is None or
                                       f"{r.waiting_reason.code}: {r.waiting_reason.detail}"[:40] in row), row
        assert rows[0].startswith("> ") and screen.selected == live[0].request_id
        assert screen.story_text.startswith(f"request {live[0].request_id}: ")
        assert f"request {stall.request_id} passed-over" in str(screen.query_one("#rq-stalls").render())
        # The stranded request: its story says it was passed over although no reason held it.
        while screen.selected != stall.request_id:
            await pilot.press("n")
        await until(pilot, lambda: screen.story is not None and screen.story.request_id == stall.request_id)
        assert "no reason held it" in screen.story_text and "> " + stall.request_id in screen.request_rows.plain
        await pilot.press("escape")
        assert not isinstance(app.screen, RequestsScreen)
    assert ("requests",) in client.calls


@pytest.mark.parametrize("size", [(80, 24), (200, 50)], ids=["80x24", "200x50"])
def test_snapshot_requests_view(snap_compare, size):
    """The requests view: two running, the rest held by max_num_seqs, one stranded (a stall), the oldest's story."""
    async def run_before(pilot):
        await _settled(pilot)
        await pilot.press("w")
        await until(pilot, lambda: getattr(pilot.app.screen, "story", None) is not None)
        await pilot.pause()

    assert snap_compare(make_app(FakeClient(HUNG)), terminal_size=size, run_before=run_before)


# -- the timeline view ---------------------------------------------------------------------------

async def test_the_timeline_view_draws_every_rank_with_its_bubbles_and_names_the_straggler():
    from devharness.tui.timeline import BUSY, IDLE, PIPE, TimelineScreen
    client = FakeClient(snapshot(57))
    client.history = lambda rank: _coro(TIMED_HISTORY[rank])
    app = make_app(client)
    async with app.run_test(size=(160, 40)) as pilot:
        await _settled(pilot)
        await pilot.press("l")
        await until(pilot, lambda: isinstance(app.screen, TimelineScreen) and app.screen.text is not None)
        screen = app.screen
        lines = screen.text.plain.splitlines()
        assert lines[0].startswith("steps 1..4: 51.0 ms across")
        rows = {int(line.split()[1]): line for line in lines[1:5]}
        assert rows[0].startswith("rank 0  tp0 pp0 ") and rows[3].startswith("rank 3  tp1 pp1 ")
        assert "bubble 30%" in rows[0] and "bubble 50%" in rows[3]
        assert "◀ straggler: late at layer 0 attention all_reduce by 12.5 ms" in rows[1]
        assert "straggler" not in rows[0] + rows[2] + rows[3]
        # Stage 0 begins at once; stage 1 5 ms later and first waits on its receive; both idle between steps.
        cells0, cells2 = screen.rows[0], screen.rows[2]
        width = len(cells0)
        at = lambda ms: int(ms / 51.0 * width)   # noqa: E731
        assert cells0[at(0.5)] == BUSY and cells2[at(0.5)] == IDLE
        assert cells2[at(7.5)] == PIPE and cells2[at(10)] == BUSY
        assert cells0[at(11)] == IDLE and cells0[at(13)] == BUSY   # between steps 1 and 2 of stage 0
        await pilot.press("escape")
        assert not isinstance(app.screen, TimelineScreen)
    assert ("timeline", 16) in client.calls


async def _coro(value):
    return value
