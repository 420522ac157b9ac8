import os
import signal
import subprocess
import sys

import pytest

from devharness.protocol.messages import EngineStats, PausedInfo, Snapshot, WorkerState
from devharness.diagnostics.hang import Blocker, find_waits, mark_stopped, root_blockers
from tests.helpers import stop_process

NOW = 1_764_400_100.0


def worker(rank: int, tp: int = 2, **kw) -> WorkerState:
    fields = dict(tp_rank=rank % tp, pp_rank=rank // tp, step=57, phase="forward",
                  detail="layer 1 attention", phase_since=NOW - 0.01)
    return WorkerState(rank=rank, **{**fields, **kw})


def paused_at(line: int = 88, since: float = NOW - 31) -> PausedInfo:
    return PausedInfo(reason="breakpoint", file="/src/devharness/model/model.py", line=line, since=since)


def snap(*workers: WorkerState) -> Snapshot:
    return Snapshot(engine=EngineStats(step=57), workers=list(workers))


def describe(s: Snapshot, threshold_s: float = 2.0) -> list[str]:
    return [w.describe() for w in find_waits(s, NOW, threshold_s)]


def test_tp_peer_in_collective_waits_for_paused_rank():
    s = snap(worker(0, phase="collective", detail="layer 3 all_reduce", phase_since=NOW - 30),
             worker(1, phase="paused", paused=paused_at()))
    [wait] = find_waits(s, NOW)
    assert wait.describe() == "rank 0 waits for rank 1 (paused at model.py:88)"
    assert (wait.phase, wait.detail, wait.waiting_s) == ("collective", "layer 3 all_reduce", 30)


def test_pp_stage_in_recv_waits_for_previous_stage():
    s = snap(worker(0, tp=1), worker(1, tp=1, phase="recv", detail="hidden states", phase_since=NOW - 5))
    assert describe(s) == ["rank 1 waits for rank 0 (in forward, layer 1 attention)"]


def test_nothing_below_threshold_or_when_the_whole_group_is_in_the_same_collective():
    short = snap(worker(0, phase="collective", phase_since=NOW - 1), worker(1, paused=paused_at()))
    together = snap(*(worker(r, phase="collective", detail="layer 3 all_reduce", phase_since=NOW - 30)
                      for r in (0, 1)))
    assert describe(short) == [] and describe(together) == []


def test_mismatched_collectives_wait_for_each_other():
    s = snap(worker(0, phase="collective", detail="layer 3 all_reduce", phase_since=NOW - 12),
             worker(1, phase="collective", detail="layer 4 all_reduce", phase_since=NOW - 12))
    assert describe(s) == ["rank 0 waits for rank 1 (in collective, layer 4 all_reduce)",
                           "rank 1 waits for rank 0 (in collective, layer 3 all_reduce)"]


def test_dead_and_lagging_peers_are_named():
    s = snap(worker(0, tp=3, phase="collective", detail="layer 0 all_reduce", phase_since=NOW - 4),
             worker(1, tp=3, phase="dead", alive=False),
             worker(2, tp=3, phase="idle", detail=None, step=56))
    assert describe(s) == ["rank 0 waits for rank 1 (dead), rank 2 (in idle, step 56)"]


def test_chain_across_stages_has_one_root():
    # tp=2, pp=2: rank 1 sits at a breakpoint; its TP peer 0 waits in all_reduce; stage 1
    # waits in recv for stage 0's hidden states.
    s = snap(worker(0, phase="collective", detail="layer 3 all_reduce", phase_since=NOW - 30),
             worker(1, phase="paused", paused=paused_at()),
             worker(2, phase="recv", detail="hidden states", phase_since=NOW - 30),
             worker(3, phase="recv", detail="hidden states", phase_since=NOW - 30))
    assert describe(s) == ["rank 0 waits for rank 1 (paused at model.py:88)",
                           "rank 2 waits for rank 0 (in collective, layer 3 all_reduce)",
                           "rank 3 waits for rank 1 (paused at model.py:88)"]
    assert root_blockers(find_waits(s, NOW)) == [Blocker(1, "paused at model.py:88")]


def test_matching_send_and_recv_are_not_a_wait():
    s = snap(worker(0, tp=1, phase="send", phase_since=NOW - 3),
             worker(1, tp=1, phase="recv", phase_since=NOW - 3))
    assert describe(s) == []


def test_the_workers_own_waiting_for_wins_over_inference():
    s = snap(worker(0, phase="collective", phase_since=NOW - 9, waiting_for=[1]),
             worker(1, phase="collective", phase_since=NOW - 9),
             worker(2, phase="recv", phase_since=NOW - 9, waiting_for="the driver's step message"))
    assert describe(s) == ["rank 0 waits for rank 1 (in collective, layer 1 attention)",
                           "rank 2 waits for the driver's step message"]


def test_exception_stop_and_missing_rank():
    s = snap(worker(0, phase="collective", phase_since=NOW - 9, waiting_for=[1, 7]),
             worker(1, phase="paused", paused=PausedInfo(reason="exception", file="C:\\w\\layers.py", line=5)))
    assert describe(s) == ["rank 0 waits for rank 1 (stopped on exception at layers.py:5), "
                           "rank 7 (not reporting)"]


def test_a_rank_left_behind_in_a_finished_collective_is_the_root_not_a_waiter():
    # Rank 1 was last seen in step 56's all_gather, which rank 0 finished (it is in step 57 now):
    # rank 1 is stuck, not waiting for rank 0, so the chain ends at rank 1.
    s = snap(worker(0, phase="collective", detail="embedding all_reduce", phase_since=NOW - 9, waiting_for=[1]),
             worker(1, step=56, phase="collective", detail="all_gather logits", phase_since=NOW - 9,
                    waiting_for=[0]))
    assert describe(s) == ["rank 0 waits for rank 1 (in collective, all_gather logits, step 56)"]
    assert root_blockers(find_waits(s, NOW)) == [Blocker(1, "in collective, all_gather logits, step 56")]
    # find_waits takes the workers alone as well as a snapshot.
    assert [w.describe() for w in find_waits(s.workers, NOW)] == describe(s)


# -- from the collective ledgers ------------------------------------------------------------------------------

def _ledger(rank: int, ops: list[tuple], started_ago: float = 0.0):
    """A tp=2 ledger: ops are (seq, shape, layer, site, state)."""
    from devharness.protocol.messages import Ledger, LedgerEntry, LedgerGroup
    ns = int((NOW - started_ago) * 1e9)
    entries = [LedgerEntry(record_id=i, group="1", op="all_reduce", collective_seq=seq, p2p_seq=0, peer=None, step=7,
                           layer=layer, site=site, in_shape=list(shape), in_dtype="float32", out_shape=list(shape),
                           out_dtype="float32", state=state, created_ns=ns, started_ns=ns,
                           completed_ns=ns if state == "completed" else 0)
               for i, (seq, shape, layer, site, state) in enumerate(ops)]
    groups = [LedgerGroup("0", "default_pg", [0, 1]), LedgerGroup("1", "tp0", [0, 1]), LedgerGroup("2", "pp0", [rank])]
    return Ledger(rank=rank, groups=groups, entries=entries, count=len(entries), capacity=4096)


def _ops(seqs, state="completed", shape=(8, 576)):
    return [(q, shape, q // 2, "attention all_reduce" if q % 2 else "mlp all_reduce", state) for q in seqs]


def test_ledgers_name_the_first_op_a_rank_never_reached_even_with_more_queued_behind_it():
    from devharness.diagnostics.hang import ledger_events
    # As on CUDA: rank 0's host queued seqs 12..15 behind the one rank 1 never joined; rank 1 is at 11.
    led0 = _ledger(0, _ops(range(1, 12)) + _ops(range(12, 16), state="started"), started_ago=9)
    led1 = _ledger(1, _ops(range(1, 12)), started_ago=9)
    states = {1: worker(1, phase="forward", detail="layer 5 attention", step=7)}
    [e] = ledger_events({0: led0, 1: led1}, states, NOW, hang_after_s=5)
    assert (e.kind, e.group, e.seq, e.op, e.waiting, e.where) == ("hang", "tp0", 12, "all_reduce", (0,),
                                                                   "layer 6 mlp all_reduce")
    assert [(b.rank, b.why) for b in e.missing] == [(1, "in forward, layer 5 attention")]
    assert ledger_events({0: led0, 1: led1}, states, NOW, hang_after_s=10) == []   # not yet
    assert ledger_events({0: led0, 1: _ledger(1, _ops(range(1, 16)))}, states, NOW, 5) == []   # all there


def test_ledgers_name_a_mismatch_at_once_with_both_sides():
    from devharness.diagnostics.hang import ledger_events
    led0 = _ledger(0, _ops(range(1, 58)))
    led1 = _ledger(1, _ops(range(1, 57)) + _ops([57], shape=(8, 288)))
    [e] = ledger_events({0: led0, 1: led1}, {}, NOW, hang_after_s=5)
    assert e.describe() == ("mismatch in group tp0 at collective 57: rank 0 all_reduce [8, 576] float32 at layer 28 "
                            "attention all_reduce, rank 1 all_reduce [8, 288] float32 at layer 28 attention all_reduce")
    assert e.waiting == (0,) and [b.rank for b in e.missing] == [1]


# -- a rank whose process is stopped ------------------------------------------------------------------------

@pytest.fixture
def stopped_pid():
    """A process stopped by SIGSTOP (process state T), continued and ended after the test."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    stop_process(proc.pid)
    yield proc.pid
    os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.wait(10)


def test_a_rank_stopped_inside_the_collective_its_peer_waits_in_is_the_root(stopped_pid):
    # tp=2 x pp=2: rank 1 was stopped inside the all-reduce rank 0 waits in. Its published state says it is in the
    # same collective, so without a look at its process rank 0 would seem merely slow and rank 2 would be blamed
    # on rank 0.
    in_it = dict(phase="collective", detail="layer 3 all_reduce", phase_since=NOW - 30)
    s = snap(worker(0, **in_it), worker(1, pid=stopped_pid, **in_it),
             worker(2, phase="recv", detail="hidden states", phase_since=NOW - 30),
             worker(3, phase="recv", detail="hidden states", phase_since=NOW - 30))
    assert describe(s) == ["rank 2 waits for rank 0 (in collective, layer 3 all_reduce)",   # what they published
                           "rank 3 waits for rank 1 (in collective, layer 3 all_reduce)"]
    seen = snap(*map(mark_stopped, s.workers))
    assert (seen.workers[1].phase, seen.workers[1].detail) == (
        "stopped", "SIGSTOP, process state T; was in collective layer 3 all_reduce, step 57")
    assert seen.workers[0] == s.workers[0]   # a running process is shown as it published
    assert describe(seen) == ["rank 0 waits for rank 1 (stopped: SIGSTOP, process state T)",
                              "rank 2 waits for rank 0 (in collective, layer 3 all_reduce)",
                              "rank 3 waits for rank 1 (stopped: SIGSTOP, process state T)"]
    [root] = root_blockers(find_waits(seen, NOW))
    assert root.named() == "rank 1 (tp 1, pp 0) is stopped (SIGSTOP, process state T)"


def _p2p(rank: int, ops: list[tuple], group: str, members: list[int], started_ago: float):
    """A pp ledger: ops are (p2p seq, op, state)."""
    from devharness.protocol.messages import Ledger, LedgerEntry, LedgerGroup
    ns = int((NOW - started_ago) * 1e9)
    entries = [LedgerEntry(record_id=i, group=group, op=op, collective_seq=0, p2p_seq=seq, peer=None, step=57,
                           layer=None, site="activations", in_shape=[8, 576], in_dtype="float32", out_shape=[8, 576],
                           out_dtype="float32", state=state, created_ns=ns, started_ns=ns,
                           completed_ns=ns if state == "completed" else 0)
               for i, (seq, op, state) in enumerate(ops)]
    return Ledger(rank=rank, groups=[LedgerGroup(group, f"pp{members[0]}", members)], entries=entries,
                  count=len(entries), capacity=4096)
