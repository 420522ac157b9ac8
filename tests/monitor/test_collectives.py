"""The collective ledger (debug/ledger.py), read from outside the workers: on clean runs every rank's entries
agree with its group peers' seq for seq (compared here, by the test's own rules), and a bundle's fr/ is read by
the installed torch's Flight Recorder analyzer (`python -m torch.distributed.flight_recorder.fr_trace`, run as a
subprocess): no mismatch on a clean run, the missing rank named on a planted stall's."""
import contextlib
import json
import pickle
import subprocess
import sys
import time
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
    bundle = tp2_pp2.runner.write_bundle()
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
        # The driver has the last step's tokens from the output rank, while rank 1 may still be closing that step's
        # last collective in its ledger (a control call on Ray's shm plane does not queue behind the step): wait
        # for every entry to be closed, then hold them to agree.
        deadline = time.monotonic() + 30
        ledgers = ledgers_of(llm)
        while any(e.state != "completed" for led in ledgers.values() for e in led.entries) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
            ledgers = ledgers_of(llm)
    steps = len({e.step for e in ledgers[0].entries})
    assert steps >= 3 and assert_ledgers_agree(ledgers) == (2 + 2 * LAYERS) * steps


@pytest.mark.parametrize("async_collectives", [False, True], ids=["blocking", "async"])
def test_a_stall_is_named_from_the_ledgers_and_fr_trace_names_the_missing_rank(async_collectives, tmp_path, capsys):
    """Rank 1 stalls before layer 0's attention all-reduce in step 2. Async: rank 0's host thread has left the
    collective's call (its own state says "forward"); it waits on the Work where the result is used, and only
    its ledger knows it waits in an all-reduce."""
    hang_after = 1.0
    with LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
             num_kv_blocks=64, hang_after_s=hang_after, inject="stall:step=2:rank=1:seconds=4",
             async_collectives=async_collectives, bundle_dir=str(tmp_path / "bundles")) as llm:
        out = llm.generate(PROMPTS[:1], PARAMS)
        events = list(llm.runner.hang_detector.events)
        ledgers = ledgers_of(llm)
    assert len(out[0].outputs[0].token_ids) == 3                  # the stall ended and the run went on
    assert ledgers[0].async_ops is async_collectives
    [e] = events
    # Step 1 made the embedding's all-reduce, 2 per layer and the logits' all-gather; step 2 its embedding's: the
    # attention all-reduce of layer 0 is the 12th of group tp0.
    assert (e.kind, e.group, e.seq, e.op, e.step) == ("hang", "tp0", 2 + 2 * LAYERS + 2, "all_reduce", 2), e
    assert e.waiting == (0,) and [b.rank for b in e.missing] == [1] and e.where == "layer 0 attention all_reduce"
    assert hang_after <= e.detected - e.since <= hang_after + 5
    assert "(group tp0, collective 12, all_reduce) for rank 1" in e.describe()
    assert_ledgers_agree(ledgers)                                  # after the stall, the ranks agree again
    [bundle] = (tmp_path / "bundles").iterdir()
    state0 = json.loads((bundle / "rank0" / "state.json").read_text())
    stacks0 = (bundle / "rank0" / "stacks.txt").read_text()
    if async_collectives:
        assert state0["phase"] == "forward" and state0["detail"] == "after layer 0 attention all_reduce", state0
        main = stacks0.split('"MainThread"')[1]
        assert "await_result" in main and "distributed_c10d" not in main, stacks0
    else:
        assert state0["phase"] == "collective" and state0["detail"] == "layer 0 attention all_reduce", state0
    code, output, collectives = fr_trace(bundle / "fr", tmp_path)
    assert code == 0, output
    assert "Not all ranks joining collective, sequence number: 12" in output and "missing ranks: {1}" in output, output
    assert "layer 0 attention all_reduce" in output
    # The side-by-side view marks the same row.
    from devharness.cli import main
    assert main(["collectives", str(bundle), "--rows", "3"]) == 0
    view = capsys.readouterr().out.splitlines()
    [marked] = [line for line in view if "<-- first" in line]
    assert marked.startswith("12 ") and marked.endswith("-   <-- first: not reached by rank 1"), view
    assert "layer 0 attention all_reduce …" in marked and len([v for v in view if v[:2].strip().isdigit()]) == 3


def test_collective_skip_and_shape_are_named_and_the_engine_serves_again(tmp_path):
    """One engine, --restart-workers: rank 1 leaves out layer 1's attention all-reduce (its mlp all-reduce pairs
    with rank 0's attention one: gloo hangs at the end of the step), then all-reduces half the hidden size there
    (gloo aborts). Each is named as a mismatch, the call fails with it, and with the fault gone it serves again."""
    from devharness.protocol.messages import InjectFault
    from devharness.executor.base import WorkerError
    hang_after = 1.0
    seq = 2 + 2   # step 1: the embedding's all-reduce, then layer 0's two: layer 1's attention all-reduce is the 4th
    with LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
             num_kv_blocks=64, hang_after_s=hang_after, inject="collective-skip:layer=1:rank=1", restart_workers=True,
             bundle_dir=str(tmp_path)) as llm:
        for fault, other in [("collective-skip", "at layer 1 mlp all_reduce"),
                             ("collective-shape", "[3, 64] float32 at layer 1 attention all_reduce")]:
            if fault == "collective-shape":
                assert llm.engine.workers.control(InjectFault(f"{fault}:layer=1:rank=1")) == [False, True]
            seen = len(llm.runner.hang_detector.events)
            with pytest.raises(WorkerError) as err:
                llm.generate(PROMPTS[:1], PARAMS)
            [e] = llm.runner.hang_detector.events[seen:]
            want = (f"mismatch in group tp0 at collective {seq}: rank 0 all_reduce [3, 128] float32 at layer 1 "
                    f"attention all_reduce, rank 1 all_reduce ")
            assert e.kind == "mismatch" and e.describe().startswith(want) and e.describe().endswith(other), e
            assert e.waiting == (0,) and [b.rank for b in e.missing] == [1] and e.op == "all_reduce"
            assert e.detected - e.since <= hang_after + 5
            assert str(err.value).startswith(e.describe()), err.value
        assert llm.engine.workers.control(InjectFault(None)) == [False, False]
        out = llm.generate(PROMPTS[:1], PARAMS)
        assert len(out[0].outputs[0].token_ids) == 3
        assert_ledgers_agree(ledgers_of(llm))
    summaries = [json.loads((b / "bundle.json").read_text()) for b in tmp_path.iterdir()]
    mismatches = [s["hang"] for s in summaries if s["reason"] == "mismatch"]
    assert [(h["kind"], h["group"], h["seq"], h["op"]) for h in mismatches] == [("mismatch", "tp0", seq, "all_reduce")] * 2


def test_collectives_view_refuses_a_missing_or_truncated_bundle(tmp_path, capsys):
    from devharness.cli import main
    (tmp_path / "b" / "rank0").mkdir(parents=True)
    (tmp_path / "b" / "rank0" / "collectives.json").write_text('{"rank": 0, "groups": [{"name": "1", "de')
    (tmp_path / "empty").mkdir()
    for args, said in [([str(tmp_path / "nope")], "no such bundle directory"),
                       ([str(tmp_path / "empty")], "not a bundle with collective ledgers"),
                       ([str(tmp_path / "b")], "rank0/collectives.json: truncated or not a collective ledger"),
                       ([], "needs a BUNDLE directory or --url URL")]:
        assert main(["collectives", *args]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and said in err, err


class QueuedWork:
    """A stand-in for an NCCL op's Work: wait() returns at once (the stream waits, not the host), is_completed()
    turns true when the GPU has run the op (`done`); its future, which completes once the op is queued, is not
    to be read."""

    def __init__(self):
        self.done, self.waits = False, 0

    def wait(self):
        self.waits += 1
        return True

    def is_completed(self):
        return self.done

    def get_future(self):
        raise AssertionError("an NCCL Work's future completes once the op is queued: it says nothing of its end")


def test_a_blocking_op_on_nccl_completes_in_the_ledger_when_its_work_does(monkeypatch):
    """A blocking all_reduce, send or recv on NCCL returns once the op is queued on the GPU: its ledger
    entry stays `started` until its Work completes. Stand-ins for torch.distributed's calls, the Works and the CUDA
    tensors (only is_cuda, shape and dtype are read): no GPU, no process group."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from devharness.debug.ledger import CollectiveLedger
    from devharness.distributed import collectives
    from devharness.distributed import parallel_state as ps

    works = []

    def queued(*args, async_op=True, **kwargs):
        assert async_op, "a blocking call on NCCL: its return does not say the op is done"
        works.append(QueuedWork())
        return works[-1]

    for name in ("all_reduce", "isend", "irecv"):
        monkeypatch.setattr(dist, name, queued)
    for name in ("send", "recv"):
        monkeypatch.setattr(dist, name, lambda *a, **k: pytest.fail("a blocking p2p call on NCCL"))
    monkeypatch.setattr(torch, "empty", lambda shape, dtype, device: cuda_like(shape, dtype))
    monkeypatch.setattr(collectives, "_async", False)
    monkeypatch.setattr(ps, "_info", ps.ParallelInfo(rank=0, tp_size=2, pp_size=2))
    monkeypatch.setattr(ps, "_tp_peers", [1])

    def cuda_like(shape, dtype=torch.float32):
        t = SimpleNamespace(is_cuda=True, shape=torch.Size(shape), dtype=dtype)
        t.contiguous = lambda: t
        return t

    groups = [ps.GroupInfo("0", "default_pg", (0, 1, 2, 3)), ps.GroupInfo("1", "tp0", (0, 1)),
              ps.GroupInfo("3", "pp0", (0, 2))]
    recorder = SimpleNamespace(layer=0, state=SimpleNamespace(step=1))
    run_id = f"nccltest{id(works)}"
    ledger = CollectiveLedger(run_id, 0, groups, recorder, backend="nccl", async_ops=False)
    observers = collectives.Observers()
    observers.add(ledger)
    with contextlib.closing(ledger), collectives.observed(observers):
        x = cuda_like((3, 8))
        assert collectives.tp_all_reduce(x, "attention all_reduce") is x
        collectives.pp_send([x])
        collectives.pp_recv([(3, 8)], torch.float32, "cuda")

        def states():
            return [e.state for e in read_ledger(run_id, 0).entries]

        assert [e.op for e in read_ledger(run_id, 0).entries] == ["all_reduce", "send", "recv"]
        assert [w.waits for w in works] == [1] * 3   # waited on once, in the call (as torch's blocking call)
        time.sleep(0.1)   # the ledger looks at its Works every few ms: none has completed
        assert states() == ["started"] * 3
        for i in (1, 2, 0):
            works[i].done = True
            want = ["completed" if w.done else "started" for w in works]
            deadline = time.monotonic() + 30
            while states() != want and time.monotonic() < deadline:
                time.sleep(0.01)
            assert states() == want
    assert collectives._current.get() is collectives._NONE   # the block's watchers are told of nothing after it
