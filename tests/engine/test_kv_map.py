"""The KV cache map (LLMEngine.kv_snapshot, served at GET /debug/kv) and the KV sanitizer.

The map is checked step by step against an independent recount: the block tables the workers were sent (the step
messages' new requests and new blocks, less the requests dropped), through a workload with prefix-cache hits,
chunked prefill and preemption. The sanitizer is shown to name each planted KV fault (the request, the block and the
step the fault's own log line says it planted) within the step, and to stay quiet on a clean mixed workload."""
import logging
import re

import pytest

from devharness import LLM, SamplingParams
from devharness.engine.kv_cache import BlockManager, KvSanitizerError
from devharness.engine.request import Request

BLOCK = 16
PREFIX = [(5 * j) % 240 + 3 for j in range(40)]   # 2 full blocks and a half, shared by the second wave


def prompt(i: int, n: int, shared: bool) -> dict:
    own = [(11 * i + 7 * j) % 251 + 5 for j in range(n)]
    return {"prompt_token_ids": (PREFIX + own) if shared else own}


class TableRecount:
    """The block tables as the workers were told them, from the step messages alone."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}

    def apply(self, so) -> None:
        for rid in so.finished_req_ids:
            self.tables.pop(rid, None)
        for r in so.new_requests:
            self.tables[r.req_id] = list(r.block_ids)
        for r in so.cached_requests:
            self.tables[r.req_id] = self.tables.get(r.req_id, []) + list(r.new_block_ids)

    def forget(self, rid: str) -> None:
        self.tables.pop(rid, None)


def test_the_map_agrees_with_the_tables_the_workers_were_sent():
    with LLM("tiny-llama", num_kv_blocks=20, max_num_batched_tokens=48, block_size=BLOCK, threads_per_worker=1,
             kv_sanitizer=True) as llm:
        engine = llm.engine
        recount = TableRecount()
        real_submit = engine.core._submit
        engine.core._submit = lambda so: (recount.apply(so), real_submit(so))[1]
        long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        for i in range(3):
            engine.add_request(prompt(i, 30, shared=True), long, f"first{i}")
        steps, compared = 0, 0
        second_wave = False
        while engine.has_unfinished_requests() or not second_wave:
            if steps == 12 and not second_wave:   # the first wave's prefix blocks are computed and cached by now
                for i in range(3):
                    engine.add_request(prompt(10 + i, 12, shared=True), long, f"second{i}")
                second_wave = True
            for out in engine.step():
                if out.finished:
                    recount.forget(out.request_id)
            steps += 1
            snap = engine.kv_snapshot()
            running = {r.request: r.blocks for r in snap.requests if r.status == "running"}
            # Tables: each running request's, as the workers hold it (a finished request's last step message
            # may still be on its way: the recount forgets it when its output says it finished).
            live = {rid: t for rid, t in recount.tables.items() if rid in running}
            assert running == live, f"step {snap.step}"
            held = [b for t in running.values() for b in t]
            assert snap.num_used == len(set(held)) and snap.num_free == snap.num_blocks - snap.num_used
            for b in range(snap.num_blocks):
                assert snap.ref_counts[b] == held.count(b), f"step {snap.step} block {b}"
            assert snap.num_cached == sum(1 for b in range(snap.num_blocks)
                                          if snap.hashes[b] is not None and b not in held)
            assert snap.usage == pytest.approx(snap.num_used / snap.num_blocks)
            compared += 1
            assert steps < 500
        stats = llm.stats()
    kinds = {e.kind for e in snap.events}
    assert {"allocate", "free", "lookup", "preempt"} <= kinds, kinds
    assert stats["num_preemptions"] > 0 and snap.preemptions == stats["num_preemptions"]
    hits = [e for e in snap.events if e.kind == "lookup" and e.blocks]
    assert hits and all(re.match(r"\d+ of \d+ full block\(s\) hit", e.detail) for e in hits)
    assert snap.prefix_hits == stats["prefix_cache_hit_tokens"] > 0
    assert snap.prefix_queries == stats["prefix_cache_query_tokens"] >= snap.prefix_hits
    assert compared > 50


def test_a_lookup_says_why_its_first_block_missed():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    mk = lambda rid, toks: Request(rid, toks, SamplingParams(), 0, (), 10_000)
    a = mk("a", list(range(9)))
    bm.step = 1
    bm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    bm.free(a)
    again = bm.lookup(mk("b", list(range(9))))
    assert len(again.blocks) == 2 and again.why_missed is None and again.describe() == "2 of 2 full block(s) hit"
    other = bm.lookup(mk("c", list(range(100, 109))))
    assert other.blocks == [] and other.why_missed == "not in the cache"
    bm.step = 7   # a request that needs every block evicts a's prefix
    z = mk("z", list(range(200, 216)))
    bm.allocate_slots(z, 16)
    gone = bm.lookup(mk("d", list(range(9))))
    assert gone.blocks == [] and gone.why_missed == "evicted at step 7"
    assert [e.kind for e in bm.events].count("evict") == 2


FAULT_LINE = {
    "kv-use-after-free": re.compile(r"planted kv-use-after-free: step (\d+) frees block (\d+) of request (\S+), which "
                                    r"still holds it, and hands it to request (\S+)"),
    "kv-leak": re.compile(r"planted kv-leak: step (\d+) keeps blocks \[(\d+)[^\]]*\] of finished request (\S+)"),
}


def run_planted(kind: str, caplog, **layout) -> tuple[str, re.Match]:
    caplog.set_level(logging.WARNING, logger="devharness.debug.kv_faults")
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (30, 50, 12, 40)]
    with LLM("tiny-llama", num_kv_blocks=48, threads_per_worker=1, kv_sanitizer=True, inject=f"{kind}:step=3",
             **layout) as llm:
        with pytest.raises(KvSanitizerError) as info:
            llm.generate([prompt(i, n, shared=False) for i, n in enumerate((20, 40, 9, 33))], params)
    [planted] = [m for r in caplog.records if (m := FAULT_LINE[kind].search(r.getMessage()))]
    return str(info.value), planted


@pytest.mark.parametrize("layout", [{}, {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}],
                         ids=["uni", "tp2"])
def test_the_sanitizer_names_a_planted_use_after_free(caplog, layout):
    message, planted = run_planted("kv-use-after-free", caplog, **layout)
    step, block, victim, taker = planted.groups()
    assert message.startswith(f"KV sanitizer, step {step}: request {victim} reads block {block}, handed to it at "
                              f"generation ")
    assert "a use after free" in message and f"taken for request {taker} at step {step}" in message


@pytest.mark.parametrize("layout", [{}, {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}],
                         ids=["uni", "tp2"])
def test_the_sanitizer_names_a_planted_leak(caplog, layout):
    message, planted = run_planted("kv-leak", caplog, **layout)
    step, first_block, rid = planted.groups()
    assert message.startswith(f"KV sanitizer, step {step}: request {rid} still holds blocks [{first_block}")
    assert "(a leak)" in message


def test_a_clean_mixed_workload_runs_200_steps_under_the_sanitizer():
    """Prefix hits, chunked prefill, preemption, eviction and aborts, with the sanitizer checking every step, the
    KV checksums included (each full block's, prefix hits at handover, a few reads a step): no report."""
    with LLM("tiny-llama", num_kv_blocks=24, max_num_batched_tokens=40, threads_per_worker=1,
             kv_sanitizer=True) as llm:
        engine, steps, n = llm.engine, 0, 0
        evicted = []
        while steps < 200:
            if engine.core.scheduler.num_preemptions == 0 or len(engine.unfinished_request_ids()) < 4:
                engine.add_request(prompt(n, 10 + 7 * (n % 5), shared=n % 2 == 0),
                                   SamplingParams(max_tokens=8 + 5 * (n % 7), temperature=0.7, seed=n,
                                                  ignore_eos=True), f"r{n}")
                n += 1
            if n % 9 == 8 and f"r{n - 3}" in engine.unfinished_request_ids():
                engine.abort_request(f"r{n - 3}")
            for out in llm.runner.step():
                assert out.outputs[0].error is None, out.outputs[0].error
            evicted += [e for e in engine.core.scheduler.block_manager.events if e.kind == "evict"]
            steps += 1
        stats = llm.stats()
        checks = engine.workers.worker.runner.kv_checksums
    assert engine.core.scheduler.step_count >= 200
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0 and evicted
    assert stats["bundle"] is None and engine.take_kv_alarms() == []
    assert checks.taken > 50 and checks.verified > 50, (checks.taken, checks.verified)


def test_the_sanitizer_is_on_in_debug_mode_unless_told_otherwise():
    from devharness.engine.args import EngineArgs
    assert EngineArgs.from_kwargs(debug=True).create_engine_config().scheduler.kv_sanitizer is True
    assert EngineArgs.from_kwargs().create_engine_config().scheduler.kv_sanitizer is False
    assert EngineArgs.from_kwargs(debug=True, kv_sanitizer=False).create_engine_config().scheduler.kv_sanitizer is False
    with pytest.raises(ValueError, match="kv_sanitizer"):
        EngineArgs.from_kwargs(kv_sanitizer="yes").create_engine_config()
    with pytest.raises(ValueError, match="replay runs the recorded steps without a scheduler"):
        from devharness.engine.replay import replay
        replay("/nonexistent-recording", inject="kv-leak:step=2")


@pytest.mark.parametrize("layout", [{}, {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}],
                         ids=["uni", "tp2"])
def test_the_workers_check_names_a_use_after_free_the_driver_missed(caplog, layout, monkeypatch, tmp_path):
    """The workers' side of the sanitizer, with the driver's invariant check switched off: a block a request
    reads must still be at the generation its table was handed; the step fails naming request, block, layer and
    step, and the supervisor writes a bundle of it."""
    monkeypatch.setattr(BlockManager, "check", lambda self, live: None)
    caplog.set_level(logging.WARNING, logger="devharness.debug.kv_faults")
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (30, 50, 12, 40)]
    with LLM("tiny-llama", num_kv_blocks=48, threads_per_worker=1, kv_sanitizer=True,
             inject="kv-use-after-free:step=3", bundle_dir=str(tmp_path), **layout) as llm:
        with pytest.raises(Exception, match="KV sanitizer") as info:
            llm.generate([prompt(i, n, shared=False) for i, n in enumerate((20, 40, 9, 33))], params)
        bundle = llm.stats()["bundle"]
    [planted] = [m for r in caplog.records if (m := FAULT_LINE["kv-use-after-free"].search(r.getMessage()))]
    step, block, victim, _ = planted.groups()
    assert re.search(rf"KV sanitizer, rank 0 \(tp 0, pp 0\), step {step}: request {victim} reads block {block} in "
                     rf"layer 0's attention, handed to it at generation \d+, but the block has since been handed out "
                     rf"at generation \d+: .*\(a use after free\)", str(info.value)), str(info.value)
    import json
    import pathlib
    summary = json.loads((pathlib.Path(bundle) / "bundle.json").read_text())
    assert summary["reason"] == "worker error" and "KV sanitizer" in summary["error"]
