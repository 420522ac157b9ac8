"""`devharness check --batch-invariance` on a GPU: the probe alone and in a batch on cuBLAS and the GPU's SDPA,
op by op; the report agrees with the probe's logprobs alone and batched (whatever the GPU's verdict is)."""
from tests.gpu.cuda import require_gpus

require_gpus(1)

from devharness import LLM, SamplingParams   # noqa: E402
from devharness.monitor.check import batch_engine_kwargs, batch_plan, run_batch_check   # noqa: E402

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}


def test_batch_check_on_the_gpu_agrees_with_the_probe_logprobs():
    report = run_batch_check("tiny-llama", PROMPT, 0.0, 4, device="cuda", max_num_batched_tokens=64)
    plan = batch_plan(PROMPT["prompt_token_ids"], 4, 16, 264, 64)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=20)
    requests = plan.requests(params)
    with LLM("tiny-llama", **batch_engine_kwargs(plan.engine, {"device": "cuda"})) as llm:
        alone = llm.generate([requests[0][1]], [params])[0].outputs[0]
        batched = llm.generate([p for _, p, _ in requests], [sp for _, _, sp in requests])[0].outputs[0]
    same = [(lp.token_logprob, lp.top_logprobs) for lp in alone.logprobs] == \
        [(lp.token_logprob, lp.top_logprobs) for lp in batched.logprobs]
    assert report.ok == same, report.verdict()
    assert report.about["preemptions"] >= 1 and report.op_summary()
