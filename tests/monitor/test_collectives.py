"""The collective ledger (debug/ledger.py), read from outside the workers: on clean runs every rank's entries
agree with its group peers' seq for seq (compared here, by the test's own rules), and a bundle's fr/ is read by
the installed torch's Flight Recorder analyzer (`python -m torch.distributed.flight_recorder.fr_trace`, run as a
subprocess): no mismatch on a clean run, the missing rank named on a planted stall's."""
import pickle
import subprocess
import sys
from collections import defaultdict

import pytest

from devharness import LLM, SamplingParams
from devharness.debug.ledger import read_ledger
from devharness.protocol.messages import Ledger

PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [7] * 20}]
LAYERS = 4   # tiny-llama's


def ledgers_of(llm) -> dict[int, Ledger]:
    """Every rank's ledger, read from its shared memory by this (the driver's) process."""
    run_id, n = llm.engine.config.run_id, llm.engine.config.parallel.world_size
    return {r: read_ledger(run_id, r) for r in range(n)}


def assert_ledgers_agree(ledgers: dict[int, Ledger]) -> int:
    """Every collective is on every rank of its group with the same op, shapes, dtype and site at the same
    sequence number; every p2p sequence number of a two-rank group is one send and the matching receive. Returns
    how many ops were compared."""
    members = {g.name: sorted(g.ranks) for led in ledgers.values() for g in led.groups}
    by_seq = defaultdict(dict)   # (group, p2p?, seq) -> {rank: entry}
    for rank, led in ledgers.items():
        assert led.count == len(led.entries) > 0, (rank, led.count)   # nothing fell out of the ring here
        for e in led.entries:
            assert e.state == "completed", e
            p2p = e.op in ("send", "recv")
            by_seq[(e.group, p2p, e.p2p_seq if p2p else e.collective_seq)][rank] = e
    for (group, p2p, seq), got in by_seq.items():
        if not p2p:
            assert sorted(got) == members[group], (group, seq, got)
            sigs = {(e.op, tuple(e.in_shape), e.in_dtype, tuple(e.out_shape), e.layer, e.site) for e in got.values()}
            assert len(sigs) == 1, (group, seq, sigs)
        else:
            (a, ea), (b, eb) = sorted(got.items())
            send, recv = (ea, eb) if ea.op == "send" else (eb, ea)
            assert (send.op, recv.op) == ("send", "recv"), (group, seq, got)
            assert {send.peer, recv.peer} == {a, b} and send.in_shape == recv.out_shape, (group, seq, got)
    # Sequence numbers count 1, 2, ... per group with no gap, on every rank.
    for rank, led in ledgers.items():
        for group in {e.group for e in led.entries}:
            colls = [e.collective_seq for e in led.entries if e.group == group and e.op not in ("send", "recv")]
            p2ps = [e.p2p_seq for e in led.entries if e.group == group and e.op in ("send", "recv")]
            assert colls == list(range(1, len(colls) + 1)) and p2ps == list(range(1, len(p2ps) + 1)), (rank, group)
    return len(by_seq)


def fr_trace(fr_dir, tmp_path) -> tuple[int, str, list]:
    """(exit code, output, the analyzer's collectives) of torch's own fr_trace on `fr_dir`."""
    out = tmp_path / "fr_db.pkl"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(fr_dir),
                        "-o", str(out)], capture_output=True, text=True, timeout=120)
    collectives = pickle.loads(out.read_bytes())[1].collectives if out.exists() else []
    return r.returncode, r.stdout + r.stderr, collectives


@pytest.fixture(scope="module")
def tp2_pp2(tmp_path_factory):
    with LLM("tiny-llama", tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="mp",
             threads_per_worker=1, num_kv_blocks=64, bundle_dir=str(tmp_path_factory.mktemp("bundles"))) as llm:
        llm.generate(PROMPTS, PARAMS)
        yield llm


def test_tp2_pp2_ledgers_agree_across_group_peers(tp2_pp2):
    ledgers = ledgers_of(tp2_pp2)
    assert_ledgers_agree(ledgers)
    ran = {e.step for e in ledgers[0].entries}          # the steps that ran a forward pass (not the empty ones)
    assert all({e.step for e in led.entries} == ran for led in ledgers.values())
    steps = len(ran)
    assert steps >= 4
    # Stage 0: the embedding's all-reduce and two per layer (2 layers), then two sends (hidden, residual) a step;
    # stage 1: two receives, two all-reduces per layer, the logits' all-gather.
    for rank, led in ledgers.items():
        ops = [e.op for e in led.entries]
        if rank < 2:
            assert ops.count("all_reduce") == 5 * steps and ops.count("send") == 2 * steps, (rank, ops)
            assert {e.group for e in led.entries} == {"1", "3" if rank == 0 else "4"}
        else:
            assert ops.count("all_reduce") == 4 * steps and ops.count("all_gather") == steps, (rank, ops)
            assert ops.count("recv") == 2 * steps
    assert [g.desc for g in ledgers[3].groups] == ["default_pg", "tp1", "pp1"] and ledgers[3].groups[2].ranks == [1, 3]


def test_a_clean_runs_bundle_passes_flight_recorders_analyzer(tp2_pp2, tmp_path):
    bundle = tp2_pp2.engine.write_bundle()
    code, output, collectives = fr_trace(f"{bundle}/fr", tmp_path)
    assert code == 0, output
    assert "Not all ranks" not in output and "has errors" not in output and "MISMATCH" not in output, output
    ledgers = ledgers_of(tp2_pp2)
    # Every op of every rank matched its peers: one analyzer collective per (group, seq), all passing.
    assert len(collectives) == assert_ledgers_agree(ledgers)
    assert all(c.pass_check for c in collectives), [c for c in collectives if not c.pass_check][:2]
    names = {c.collective_name for c in collectives}
    assert {"gloo:all_reduce", "gloo:all_gather"} < names <= {"gloo:all_reduce", "gloo:all_gather",
                                                             "gloo:send 0->1", "gloo:recv 1<-0"}, names


@pytest.mark.parametrize("backend", ["ray"])
def test_tp2_ray_ledgers_agree(backend, ray_instance):
    with LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend=backend, threads_per_worker=1,
             num_kv_blocks=64) as llm:
        llm.generate(PROMPTS, PARAMS)
        ledgers = ledgers_of(llm)
    steps = len({e.step for e in ledgers[0].entries})
    assert steps >= 3 and assert_ledgers_agree(ledgers) == (2 + 2 * LAYERS) * steps
