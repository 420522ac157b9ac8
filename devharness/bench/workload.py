"""The workload of `bench throughput` and its `--pipeline` comparison: random prompts and output lengths from
the seed, and one run of them through an engine."""
from __future__ import annotations

import random
import time


def make_workload(args, vocab_size: int):
    rng = random.Random(args.seed)
    return [([rng.randrange(100, vocab_size) for _ in range(rng.randint(*args.prompt_len))],
             rng.randint(*args.output_len)) for _ in range(args.num_requests)]


def run_engine(llm, workload) -> float:
    """Seconds to run `workload` to its end, every prompt computed whole: the prefix cache is emptied first, or a
    workload run again (a warm-up's requests, an earlier round's) would skip the prefill of its prompts' full
    blocks (at 16-32 tokens, two thirds of their tokens), which transformers and the first run do not."""
    from devharness import SamplingParams
    inputs = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in workload]
    if not llm.reset_prefix_cache():
        raise RuntimeError("the engine is still running requests: its prefix cache cannot be emptied")
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params)
    elapsed = time.perf_counter() - t0
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(n for _, n in workload)
    return elapsed
