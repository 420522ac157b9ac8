"""The worker-state files: what a reader in another process sees of a recorder's phases, steps and
pauses, read while the writer runs on."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid

import pytest

from devharness.debug import state as ds
from devharness.debug.board import MAX_SITES
from devharness.diagnostics.hang import hang_report


@pytest.fixture


def run_id():
    rid = f"test-{uuid.uuid4().hex[:8]}"
    yield rid
    ds.remove_run_files(rid)


def _recorder(run_id: str, rank: int = 0, **kw) -> ds.StateRecorder:
    return ds.StateRecorder(ds.WorkerState(rank=rank, tp_rank=rank, pp_rank=0, node_ip="127.0.0.1",
                                           pid=os.getpid()), run_id, **kw)


@pytest.fixture


def rec(run_id):
    recorder = _recorder(run_id, history_len=4)
    yield recorder
    recorder.close()


def _read(run_id: str, rank: int = 0) -> ds.WorkerState:
    reader = ds.StateReader(run_id, rank)
    try:
        return reader.state()
    finally:
        reader.close()


def _same_as_snapshot(rec: ds.StateRecorder, run_id: str) -> ds.WorkerState:
    got, snap = _read(run_id), rec.snapshot()
    assert got.phase_since == pytest.approx(snap.phase_since, abs=2e-6)   # the word keeps microseconds
    got.phase_since = snap.phase_since
    assert got == snap
    return got


def test_a_step_as_a_reader_sees_it(rec, run_id):
    st = _same_as_snapshot(rec, run_id)
    assert (st.phase, st.step, st.last_step_ms) == ("idle", 0, None)
    t0 = time.time()
    rec.begin_step(7, num_reqs=3, num_tokens=40)
    st = _same_as_snapshot(rec, run_id)
    assert (st.phase, st.step, st.num_reqs, st.num_tokens) == ("prepare", 7, 3, 40)
    assert t0 - 0.01 <= st.phase_since <= time.time() + 0.01
    rec.set_phase("forward")
    rec.layer = 3
    rec.enter("collective", "mlp all_reduce", [1], layer=rec.layer)
    st = _same_as_snapshot(rec, run_id)
    assert (st.phase, st.detail, st.waiting_for) == ("collective", "layer 3 mlp all_reduce", [1])
    entered = st.phase_since
    time.sleep(0.002)
    rec.leave()
    st = _same_as_snapshot(rec, run_id)
    assert (st.phase, st.detail, st.waiting_for) == ("forward", "after layer 3 mlp all_reduce", None)
    assert st.phase_since >= entered + 0.002 - 1e-6
    rec.enter("send", "activations to rank 2", [2])
    assert (_read(run_id).phase, _read(run_id).waiting_for) == ("send", [2])
    rec.leave()
    rec.set_phase("sample")
    rec.state.kv_blocks_used = 5
    rec.end_step()
    st = _same_as_snapshot(rec, run_id)
    assert (st.phase, st.detail, st.step, st.kv_blocks_used) == ("idle", "", 7, 5)
    [record] = ds.StateReader(run_id, 0).history()
    assert record == rec.history()[0]
    assert record.step == 7 and record.num_tokens == 40 and record.total_ms == st.last_step_ms
    assert set(record.phases) == {"prepare", "forward", "collective", "send", "sample"}
    assert record.phases["collective"] >= 2.0
    assert sum(record.phases.values()) == pytest.approx(record.total_ms, rel=1e-6)


def test_a_site_is_the_same_each_time_it_is_met(rec, run_id):
    for step in (1, 2):
        rec.begin_step(step, 1, 1)
        rec.set_phase("forward")
        for layer in range(3):
            for what in ("attn all_reduce", "mlp all_reduce"):
                rec.enter("collective", what, [1], layer=layer)
                st = _read(run_id)
                assert (st.detail, st.waiting_for) == (f"layer {layer} {what}", [1])
                rec.leave()
                assert _read(run_id).detail == f"after layer {layer} {what}"
        rec.end_step()
    assert len(rec._sites) == len(ds.PHASES) + 1 + 6   # plain phases, forward-from-prepare, 6 collectives


def test_a_full_site_table_falls_back_to_the_plain_phase(rec, run_id):
    rec.begin_step(1, 1, 1)
    for i in range(MAX_SITES + 5):
        rec.enter("collective", f"all_reduce {i}", [1])
        rec.leave()
    rec.enter("collective", "one too many", [1])
    st = _same_as_snapshot(rec, run_id)
    assert (st.phase, st.detail, st.waiting_for) == ("collective", "", None)


def test_progress_ends_a_pause(rec, run_id):
    rec.begin_step(1, 1, 1)
    rec.set_paused("breakpoint", "model.py", 12)
    st = _read(run_id)
    assert (st.paused.reason, st.paused.file, st.paused.line) == ("breakpoint", "model.py", 12)
    rec.set_phase("forward")
    st = _same_as_snapshot(rec, run_id)
    assert st.paused is None and st.phase == "forward"


def test_history_keeps_the_last_steps_oldest_first(rec, run_id):
    for step in range(1, 11):
        rec.begin_step(step, 1, step)
        rec.end_step()
    assert [r.step for r in ds.StateReader(run_id, 0).history()] == [7, 8, 9, 10]
    assert [r.num_tokens for r in rec.history()] == [7, 8, 9, 10]


def _write_steps(run_id: str, started, stop, last, release) -> None:
    """Steps as fast as it can until `stop` (or ten minutes, should the test be gone), then says its last step in
    `last` and keeps its files until `release`."""
    rec = _recorder(run_id)
    started.set()
    deadline, step = time.monotonic() + 600, 0
    while not (step % 50 == 0 and (stop.is_set() or time.monotonic() > deadline)):
        step += 1
        rec.begin_step(step, step % 97, 2 * step)
        rec.set_phase("forward")
        for layer in range(4):
            rec.layer = layer
            rec.enter("collective", "attn all_reduce", [1], layer=layer)
            rec.leave()
        rec.state.kv_blocks_used = 3 * step
        rec.end_step()
        if step % 50 == 0:
            rec.publish()
    last.value = step
    release.wait(120)
    rec.close()


def _check_whole(st: ds.WorkerState) -> None:
    """The step's fields agree with each other, the detail with the phase, the phase time with the clock."""
    if st.step:
        assert (st.num_reqs, st.num_tokens) == (st.step % 97, 2 * st.step), st
        assert st.kv_blocks_used in (3 * st.step, 3 * (st.step - 1)), st
    if st.phase == "collective":
        assert st.detail.startswith("layer ") and st.detail.endswith(" attn all_reduce"), st
        assert st.waiting_for and len(st.waiting_for) == 1, st
    elif st.detail:
        assert st.phase == "forward" and st.detail.startswith("after layer "), st
    assert abs(time.time() - st.phase_since) < 30, st


# Distinct steps the reader must see while the writer runs: it keeps up, whatever this machine's speed.
DISTINCT_STEPS = 50


def test_a_reader_never_sees_a_torn_state(run_id):
    """A writer process runs steps as fast as it can; every state read meanwhile is whole (_check_whole) and none
    is older than the one read before it. The reader reads until it has seen DISTINCT_STEPS steps and both phases
    of a step (a generous deadline, not a rate), then stops the writer; the writer's last step is what it reads."""
    ctx = mp.get_context("spawn")
    started, stop, release, last = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Value("q", 0)
    writer = ctx.Process(target=_write_steps, args=(run_id, started, stop, last, release))
    writer.start()
    try:
        assert started.wait(60)
        reader = ds.StateReader(run_id, 0)
        seen_steps, phases, reads, newest = set(), set(), 0, 0
        deadline = time.monotonic() + 120
        while len(seen_steps) < DISTINCT_STEPS or not {"collective", "forward"} <= phases:
            assert writer.is_alive() and time.monotonic() < deadline, (reads, len(seen_steps), phases)
            st = reader.state()
            if st is None:
                continue
            reads += 1
            _check_whole(st)
            assert st.step >= newest, (st.step, newest)   # never an older step than one read before
            newest = st.step
            seen_steps.add(st.step)
            phases.add(st.phase)
        stop.set()
        deadline = time.monotonic() + 60
        while not last.value:
            assert writer.is_alive() and time.monotonic() < deadline, "the writer did not stop"
            time.sleep(0.01)
        st = reader.state()
        _check_whole(st)
        assert (st.step, st.phase) == (last.value, "idle") and st.step >= newest, (st, last.value, newest)
        reader.close()
    finally:
        stop.set()
        release.set()
        writer.join(60)
    assert writer.exitcode == 0


def test_hang_report_names_who_did_not_arrive(run_id):
    """Rank 0 waits for rank 1 in step 5. Rank 1 either never started step 5 (idle after 4), or was
    last seen inside step 4's all_gather, which rank 0 finished: it did not arrive either way."""
    recs = [_recorder(run_id, rank) for rank in (0, 1)]
    try:
        for rec in recs:
            rec.begin_step(4, 1, 1)
            rec.enter("collective", "all_gather logits", [1 - rec.state.rank])
        recs[0].leave()
        recs[0].end_step()
        recs[0].begin_step(5, 1, 1)
        recs[0].enter("collective", "embedding all_reduce", [1])
        report = hang_report(run_id, 2, step=5)
        assert report.startswith("did not arrive: rank 1 (tp 1, pp 0) stuck in step 4, last seen in collective "
                                 "all_gather logits"), report
        assert "waiting: rank 0 (tp 0, pp 0) collective embedding all_reduce" in report and "[1]" in report
        recs[1].leave()
        recs[1].end_step()
        report = hang_report(run_id, 2, step=5)
        assert report.startswith("did not arrive: rank 1 (tp 1, pp 0) never started step 5 (last finished "
                                 "step 4"), report
    finally:
        for rec in recs:
            rec.close()


def test_steps_one_after_another_never_overlap_when_the_thread_is_held_between_clocks(rec, monkeypatch):
    """A step's start (a wall time) and its length come from one clock: a thread preempted between reading the
    monotonic clock and the wall clock (here, the wall clock read 50 ms late at step 1's start) does not
    push a step's start past its true one, so its slice never overlaps the next step's in a trace."""
    real, reads = time.time, []

    def late_once():   # what a 50 ms preemption in step 1's begin_step reads, and no other
        reads.append(1)
        return real() + (0.05 if len(reads) == 1 else 0.0)
    monkeypatch.setattr(ds.time, "time", late_once)
    for step in (1, 2, 3):
        rec.begin_step(step, 1, 1)
        time.sleep(0.01)
        rec.end_step()
    steps = rec.history()[-3:]
    assert [s.step for s in steps] == [1, 2, 3]
    for a, b in zip(steps, steps[1:]):
        assert a.started_at + a.total_ms / 1000 <= b.started_at + 1e-6, (a, b)
