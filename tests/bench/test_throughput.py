"""bench/throughput.py's timed runs: each computes its whole workload, however often it has run before."""
import argparse

from devharness import LLM
from devharness.bench.throughput import make_workload, run_engine


def test_a_workload_run_again_computes_its_prompts_whole():
    args = argparse.Namespace(seed=0, num_requests=6, prompt_len=(20, 40), output_len=(2, 4))
    with LLM("tiny-llama") as llm:
        workload = make_workload(args, 264)
        prompt_tokens = sum(len(p) for p, _ in workload)
        run_engine(llm, workload[:2])          # a warm-up: the first two prompts' full blocks are cached
        before = llm.stats()["num_computed_tokens_total"]
        for _ in range(2):                      # the bench's rounds run the same workload again
            run_engine(llm, workload)
        assert llm.stats()["prefix_cache_hit_tokens"] == 0
        # Every prompt token and every output token but the last of each request went through the model.
        outputs = sum(n - 1 for _, n in workload)
        assert llm.stats()["num_computed_tokens_total"] - before == 2 * (prompt_tokens + outputs)
