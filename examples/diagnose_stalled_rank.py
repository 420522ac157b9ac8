"""Story: "the run froze at step 3". Find which rank stalled, where the others wait, and what it was doing.

A planted stall (`inject="stall:step=3:rank=1:seconds=6"`, `--inject` on the command line) makes rank 1
sleep at step 3 of a tp=2 run, with no debugger anywhere. The hang detector, always on, reads the
workers' published states: after `hang_after_s` (`--hang-after`) it reports that rank 0 waits in an
all-reduce for rank 1, which never arrived, and writes a bundle: `hang.txt` (who waits for whom),
per rank `state.json`, `log.txt` and `stacks.txt` (py-spy, read from outside the stuck process).
Rank 1's stacks show the sleep it is stuck in. Here the stall ends after 6 s and the run finishes;
a real hang would still have left the bundle (`devharness replay BUNDLE` replays up to the hung step).

Exits non-zero unless the event and the bundle name rank 1 and its stacks show where it was.
"""
import json
import sys
import tempfile
from pathlib import Path

from devharness import LLM, SamplingParams


def fail(why: str):
    sys.exit(f"diagnose_stalled_rank: the story did not come out: {why}")


if __name__ == "__main__":   # the mp executor starts worker processes that import this file
    bundles = Path(tempfile.mkdtemp(prefix="devharness-bundles-"))
    with LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
             hang_after_s=1.0, inject="stall:step=3:rank=1:seconds=6", bundle_dir=str(bundles)) as llm:
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=5, ignore_eos=True))
        # /debug/workers showed the hang as engine.hang while it lasted, and clears it once the step went on: the
        # detector keeps its events, and engine.bundle the last bundle written.
        events, bundle = list(llm.runner.hang_detector.events), llm.stats()["bundle"]
    hangs = [e.describe() for e in events if e.kind == "hang"]
    if len(hangs) != 1 or bundle is None:
        fail(f"expected one hang event and a bundle, got {hangs!r} and {bundle!r}")
    hang = hangs[0]
    print("hang event:", hang)

    bundle = Path(bundle)
    summary = json.loads((bundle / "bundle.json").read_text())
    print(f"bundle {bundle} ({summary['reason']}, failing step {summary['failing_step']}):")
    hang_txt = (bundle / "hang.txt").read_text()
    print(hang_txt)
    stacks = (bundle / "rank1" / "stacks.txt").read_text()
    where = [line.strip() for line in stacks.splitlines() if "faults.py" in line or "stall" in line]
    print("rank 1's stack, where it is stuck:", *where[:3], sep="\n  ")
    if "for rank 1" not in hang:
        fail("the hang event does not name rank 1")
    if summary["reason"] != "hang" or "did not arrive: rank 1" not in hang_txt or "waiting: rank 0" not in hang_txt:
        fail("the bundle does not say rank 0 waits for rank 1")
    if not where:
        fail("rank 1's stacks do not show the stall")
    if len(out[0].outputs[0].token_ids) != 5:
        fail("the run did not finish once the stall ended")
