"""The collective ledger on NCCL (tp=2 on two GPUs, async collectives by default on CUDA): a planted stall is named
from the ledgers (the waiting rank's host thread queues on past the all-reduce its peer never joined), and the
bundle's fr/ passes torch's own Flight Recorder analyzer."""
from tests.gpu.cuda import require_gpus

require_gpus(2)

import json   # noqa: E402

from devharness import LLM, SamplingParams   # noqa: E402
from tests.monitor.test_collectives import assert_ledgers_agree, fr_trace, ledgers_of   # noqa: E402

PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def test_nccl_stall_is_named_from_the_ledgers_and_passes_fr_trace(tmp_path):
    hang_after = 1.0
    with LLM("tiny-llama", device="cuda", tensor_parallel_size=2, distributed_executor_backend="mp",
             num_kv_blocks=64, hang_after_s=hang_after, inject="stall:step=2:rank=1:seconds=5",
             bundle_dir=str(tmp_path / "bundles")) as llm:
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], PARAMS)
        events = list(llm.runner.hang_detector.events)
        ledgers = ledgers_of(llm)
    assert len(out[0].outputs[0].token_ids) == 3
    assert ledgers[0].backend == "nccl" and ledgers[0].async_ops
    [e] = events
    assert (e.kind, e.group, e.seq, e.op, e.waiting) == ("hang", "tp0", 12, "all_reduce", (0,)), e
    assert [b.rank for b in e.missing] == [1] and hang_after <= e.detected - e.since <= hang_after + 5
    assert_ledgers_agree(ledgers)
    [bundle] = (tmp_path / "bundles").iterdir()
    assert json.loads((bundle / "bundle.json").read_text())["hang"]["missing"][0]["rank"] == 1
    code, output, _ = fr_trace(bundle / "fr", tmp_path)
    assert code == 0 and "missing ranks: {1}" in output, output
