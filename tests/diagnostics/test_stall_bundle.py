"""A stall the scheduler's detector reports (engine/request_story.py) leaves a bundle behind, once per stall kind and
request however long it goes on: bundle.json names the stall, requests.json holds the stalled request's story."""
import json
import logging
import re

from devharness import LLM, SamplingParams
from tests.helpers import wait_until


def test_sched_strand_writes_one_bundle_with_the_stalled_requests_story(tmp_path, caplog):
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    k = 4   # --stall-steps
    with caplog.at_level(logging.WARNING), LLM("tiny-llama", inject="sched-strand:step=3", stall_steps=k,
                                               bundle_dir=str(tmp_path), threads_per_worker=1) as llm:
        runner, engine = llm.runner, llm.engine
        for n in range(k + 16):   # one request arrives each step, long past the stall: it stays stranded
            engine.add_request({"prompt_token_ids": [5 + n, 6, 7, 8]}, params, f"q{n}")
            runner.step()
        wait_until(lambda: runner.bundles.paths, 60, "the stall's bundle")
        snap = engine.requests_snapshot()
    picked = re.search(r"planted sched-strand: from step (\d+) the scheduler skips request ([^\s,]+)", caplog.text)
    assert picked, caplog.text
    [stall] = snap.stalls
    assert (stall.kind, stall.request_id) == ("passed-over", picked.group(2))
    [bundle] = list(tmp_path.iterdir())   # the shutdown waited for its writer; no second one came
    summary = json.loads((bundle / "bundle.json").read_text())
    assert summary["reason"] == "stall"
    assert [(s["kind"], s["request_id"], s["steps"]) for s in summary["stalls"]] == [("passed-over", stall.request_id, k)]
    requests = json.loads((bundle / "requests.json").read_text())
    assert [(s["kind"], s["request_id"]) for s in requests["stalls"]] == [("passed-over", stall.request_id)]
    story = next(r for r in requests["requests"] if r["request_id"] == stall.request_id)
    assert story["state"] == "waiting" and story["num_output_tokens"] == 0
    waits = [e for e in story["events"] if e["kind"] == "wait"]
    assert waits and waits[-1]["count"] >= k and "no reason held it" in waits[-1]["detail"]
    assert requests["step"] == stall.step == summary["engine"]["step"]   # read together, right after that step
    assert (bundle / "rank0" / "state.json").exists()
