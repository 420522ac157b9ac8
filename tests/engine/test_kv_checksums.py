"""The KV checksums (debug/kv_checksums.py), the KV sanitizer's check of what the cache holds.

A checksum catches any one flipped bit, in every dtype the cache holds. Each planted fault is named by the rank that
holds the bad data, with the block and layer its own log line says it planted, the request that wrote the block and
the one reading it, and the step: a kv-bitflip (one rank's copy changed after it was written) at tp=1 and on rank 1
of tp=2, a kv-stale-hit (a re-filled block still named by the prefix cache) by every rank. The request that read it
ends with the error, the others go on, and a bundle is written."""
import json
import logging
import pathlib
import re
from types import SimpleNamespace

import pytest
import torch

from devharness import LLM, SamplingParams
from devharness.debug.kv_checksums import READ_EVERY, KvChecksums

PREFIX = [(5 + 7 * i) % 250 for i in range(41)]     # 2 full blocks of 16 and 9 tokens
OTHER = [(3 * i) % 200 + 20 for i in range(100)]    # 6 full blocks and 4 tokens, nothing in common with PREFIX
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
LAYOUTS = {"uni": {}, "tp2": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
           "pp2": {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_single_bit_flip_changes_the_checksum(dtype):
    """Every bit of a block's keys and values, in each layer, flipped alone: that block's checksum at that layer
    changes, the others' do not."""
    torch.manual_seed(0)
    kv = torch.randn(2, 2, 3, 4, 2, 8).to(dtype)   # [layer, key|value, block, slot, head, dim]
    sums = KvChecksums(kv, 0, 4, "rank 0", 0)
    clean = sums._compute([0, 1, 2])
    bits = kv.element_size() * 8
    for layer, kind in ((0, 0), (1, 1)):
        words = kv[layer, kind, 1].view(-1).view(torch.int16 if bits == 16 else torch.int32)
        for i in range(words.numel()):
            for bit in range(bits):
                mask = torch.tensor(1 << bit if bit < bits - 1 else -(1 << bit), dtype=words.dtype)
                words[i] ^= mask
                now = sums._compute([0, 1, 2])
                assert now[1, layer, kind] != clean[1, layer, kind], (layer, kind, i, bit)
                changed = (now != clean).nonzero().tolist()
                assert changed == [[1, layer, kind]], changed
                words[i] ^= mask
    assert torch.equal(sums._compute([0, 1, 2]), clean)


def run_waves(inject: str, tmp_path, caplog, layout: dict, planted: str):
    """Three waves, one request at a time through the runner: PREFIX (fills blocks 0 and 1), OTHER (takes every other
    block, evicting PREFIX's second), then PREFIX's 32 first tokens again with a request of its own beside it. The
    outputs of the last wave, the bundle's summary and the fault's log line (a worker process's: in the bundle's copy
    of its log)."""
    caplog.set_level(logging.WARNING)
    with LLM("tiny-llama", num_kv_blocks=8, threads_per_worker=1, kv_sanitizer=True, inject=inject,
             bundle_dir=str(tmp_path), **layout) as llm:
        first = llm.generate([{"prompt_token_ids": PREFIX}], ONE)
        llm.generate([{"prompt_token_ids": OTHER}], ONE)
        last = llm.generate([{"prompt_token_ids": PREFIX[:32] + [9, 9, 9]}, {"prompt_token_ids": [77] * 20}], ONE)
        bundle = llm.stats()["bundle"]
    assert bundle is not None, "no bundle written"
    logs = [r.getMessage() for r in caplog.records]
    if layout:
        logs += [text for log in pathlib.Path(bundle).glob("rank*/log.txt") for text in log.read_text().splitlines()]
    [line] = [m for text in logs if (m := re.search(planted, text))]
    summary = json.loads((pathlib.Path(bundle) / "bundle.json").read_text())
    return first[0].request_id, last, summary, line


@pytest.mark.parametrize("layout, layer, rank", [("uni", 2, None), ("tp2", 2, 1), ("pp2", 1, 0)])
def test_a_bitflip_is_named_by_the_rank_that_holds_it(layout, layer, rank, tmp_path, caplog):
    """At pp=2 the bad copy is on the first stage's rank, which returns no tokens: its report still comes back."""
    assert_bitflip_named(LAYOUTS[layout], layer, rank, tmp_path, caplog)


def assert_bitflip_named(layout: dict, layer: int, rank: int | None, tmp_path, caplog):
    """A kv-bitflip planted at `layer` on `rank` (None: no rank given, at tp=1) is named by that rank alone, at the
    block its log line names, with the request that wrote it and the one reading it; only the reader ends."""
    spec = f"kv-bitflip:layer={layer}" + ("" if rank is None else f":rank={rank}")
    writer, (reader, bystander), summary, line = run_waves(
        spec, tmp_path, caplog, layout,
        rf"planted kv-bitflip: rank (\d+), step (\d+): block (\d+), layer {layer}: a bit of its first key flipped")
    flipped_on, flipped_at, block = (int(g) for g in line.groups())
    assert flipped_on == (rank or 0)
    out = reader.outputs[0]
    assert out.finish_reason == "error", out
    # Only the rank that holds the bad copy names it; at tp=2 rank 0's copy is right.
    [alarm] = out.error.split("; ")
    r = rank or 0
    tp = r % layout.get("tensor_parallel_size", 1)
    pp = r // layout.get("tensor_parallel_size", 1)
    assert re.fullmatch(rf"KV checksum, rank {r} \(tp {tp}, pp {pp}\), step (\d+): block {block}, layer {layer}: its "
                        rf"keys differ from their checksum taken when request {writer} wrote it at step 1 \(handed "
                        rf"over by a prefix hit, held by request\(s\) {reader.request_id}\)", alarm), alarm
    assert int(re.search(r"step (\d+)", alarm).group(1)) >= flipped_at
    assert bystander.outputs[0].finish_reason == "length" and bystander.outputs[0].error is None
    assert summary["reason"] == "kv checksum" and alarm in summary["error"]


@pytest.mark.parametrize("layout", ["uni", "tp2"])
def test_a_stale_hit_is_named_by_every_rank(layout, tmp_path, caplog):
    assert_stale_hit_named(LAYOUTS[layout], tmp_path, caplog)


def assert_stale_hit_named(layout: dict, tmp_path, caplog):
    """A kv-stale-hit is named by every rank (each holds its share of the other tokens' keys and values)."""
    _, (reader, bystander), summary, line = run_waves(
        "kv-stale-hit", tmp_path, caplog, layout,
        r"planted kv-stale-hit: step (\d+) hands block (\d+) to request (\S+) but keeps its old hash")
    step, block, refiller = line.groups()
    out = reader.outputs[0]
    assert out.finish_reason == "error", out
    alarms = out.error.split("; ")
    ranks = range(layout.get("tensor_parallel_size", 1))
    assert len(alarms) == len(ranks)
    for r, alarm in zip(ranks, alarms):
        assert re.fullmatch(rf"KV checksum, rank {r} \(tp {r}, pp 0\), step \d+: block {block}, layers 0-3: handed to "
                            rf"request {reader.request_id} from the prefix cache as its block 1, but it (was handed to "
                            rf"request {refiller} for new tokens at step {step}.*|holds the keys and values of other "
                            rf"tokens, written by request {refiller} .*) \(a stale prefix-cache hit\)", alarm), alarm
    assert bystander.outputs[0].finish_reason == "length" and bystander.outputs[0].error is None
    assert summary["reason"] == "kv checksum"


def test_clean_waves_raise_no_alarm(tmp_path, caplog):
    """The same waves with nothing planted: the last wave's prefix hit is checked and passes (control)."""
    caplog.set_level(logging.WARNING)
    with LLM("tiny-llama", num_kv_blocks=8, threads_per_worker=1, kv_sanitizer=True, bundle_dir=str(tmp_path)) as llm:
        llm.generate([{"prompt_token_ids": PREFIX}], ONE)
        last = llm.generate([{"prompt_token_ids": PREFIX[:32] + [9, 9, 9]}], ONE)
        checks = llm.engine.workers.worker.runner.kv_checksums
        assert llm.stats()["prefix_cache_hit_tokens"] == 32 and llm.stats()["bundle"] is None
    assert last[0].outputs[0].finish_reason == "length"
    assert (checks.taken, checks.verified) == (2, 2)   # PREFIX fills 2 blocks; the last wave is handed both


def test_a_bitflip_in_a_block_being_read_is_named_at_its_next_read_check(tmp_path, caplog):
    """No prefix hit: the request that wrote the block reads it on in its decodes; the read checks (every READ_EVERY
    steps, each running request's blocks in turn) find the flip at the first of them after it, and only that request
    ends."""
    caplog.set_level(logging.WARNING)
    with LLM("tiny-llama", num_kv_blocks=16, threads_per_worker=1, kv_sanitizer=True, inject="kv-bitflip:layer=1",
             bundle_dir=str(tmp_path)) as llm:
        outs = llm.generate([{"prompt_token_ids": PREFIX}, {"prompt_token_ids": [77] * 10}],
                            SamplingParams(max_tokens=2 * READ_EVERY, temperature=0, ignore_eos=True))
    [line] = [m for r in caplog.records if (m := re.search(r"planted kv-bitflip: rank 0, step (\d+): block (\d+)",
                                                           r.getMessage()))]
    flipped_at, block = (int(g) for g in line.groups())
    found_at = -(-flipped_at // READ_EVERY) * READ_EVERY
    reader, bystander = outs
    assert reader.outputs[0].finish_reason == "error"
    assert reader.outputs[0].error == (
        f"KV checksum, rank 0 (tp 0, pp 0), step {found_at}: block {block}, layer 1: its keys differ from their "
        f"checksum taken when request {reader.request_id} wrote it at step 1 (read by attention, held by request(s) "
        f"{reader.request_id})")
    assert len(reader.outputs[0].token_ids) == found_at - 1   # the step that found it sampled nothing for it
    assert bystander.outputs[0].finish_reason == "length" and len(bystander.outputs[0].token_ids) == 2 * READ_EVERY


def test_the_kv_checksums_profile_times_their_calls_and_counts_their_blocks():
    """The workers' "kv-checksums" profile (what bench debug-overhead reads): each step's, the checksums' and the
    generation checks' thread CPU time, the blocks checksummed and verified under it; at stop the checksums and the
    generation check are the classes' methods again."""
    with LLM("tiny-llama", num_kv_blocks=32, threads_per_worker=1, kv_sanitizer=True) as llm:
        runner = llm.engine.workers.worker.runner
        checks = runner.kv_checksums
        llm.generate([{"prompt_token_ids": PREFIX}], ONE)
        taken, verified = checks.taken, checks.verified
        llm.start_profile("kv-checksums")
        llm.generate([{"prompt_token_ids": PREFIX[:32] + [9] * 20}, {"prompt_token_ids": OTHER}], ONE)
        [result] = llm.stop_profile()
        assert "after_step" not in vars(checks) and "check_kv_generations" not in vars(runner)
    calls = result.calls
    assert result.kind == "kv-checksums" and calls["steps"].calls == result.steps >= 1
    assert calls["checksums"].calls == calls["generations"].calls == result.steps
    assert 0 < calls["checksums"].seconds < calls["steps"].seconds
    assert 0 <= calls["generations"].seconds < calls["steps"].seconds
    # The second wave fills its own third block and OTHER's six; the prefix hit hands over PREFIX's two.
    assert (calls["blocks checksummed"].calls, calls["blocks verified"].calls) == (7, 2)
    assert (checks.taken - taken, checks.verified - verified) == (7, 2)
