"""The engine on one GPU: greedy tokens equal to transformers' on the same checkpoint (both on the GPU), every
tensor of the model, its KV cache, each step's inputs and the sampler's on the GPU, seeded sampling that does
not depend on the batch there, and logprobs that agree with the CPU's."""
import pytest
import torch

from tests.gpu.cuda import assert_tensors_live_on, require_gpus

require_gpus(1)

from devharness import LLM, SamplingParams   # noqa: E402
from devharness.model.builtin import TINY_ARCH   # noqa: E402
from tests.helpers import as_inputs, mixed_prompts   # noqa: E402

import transformers
GPU = torch.device("cuda", 0)
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_hf_dir):
    with LLM(str(tiny_hf_dir), distributed_executor_backend="uni", device="cuda", seed=0) as llm:
        yield llm


def transformers_greedy(path, prompts, max_new_tokens):
    model = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).to(GPU).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=GPU)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=TINY_ARCH.vocab_size - 1)
            outs.append(out[0, len(p):].tolist())
    return outs


def test_greedy_tokens_equal_transformers(llm, tiny_hf_dir):
    prompts = mixed_prompts(10)
    got = [o.outputs[0].token_ids for o in llm.generate(as_inputs(prompts), GREEDY)]
    assert got == transformers_greedy(tiny_hf_dir, prompts, GREEDY.max_tokens)


def test_model_cache_inputs_and_sampler_live_on_the_gpu(llm, monkeypatch):
    assert_tensors_live_on(llm, GPU, monkeypatch)


def test_seeded_sampling_does_not_depend_on_the_batch(llm):
    prompt, params = [3, 1, 4, 1, 5], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=11,
                                                   ignore_eos=True)
    alone = llm.generate(as_inputs([prompt]), params)[0].outputs[0].token_ids
    crowd = mixed_prompts(6, seed=4)
    together = llm.generate(as_inputs(crowd + [prompt]),
                            [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in range(6)]
                            + [params])[-1].outputs[0].token_ids
    assert together == alone
    assert len(set(alone)) > 4   # sampled, not stuck on one token


def test_logprobs_agree_with_the_cpu(llm, tiny_hf_dir):
    prompts = as_inputs(mixed_prompts(3, seed=2))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    gpu = llm.generate(prompts, params)
    with LLM(str(tiny_hf_dir), distributed_executor_backend="uni", seed=0) as cpu_llm:
        cpu = cpu_llm.generate(prompts, params)
    for g, c in zip(gpu, cpu):
        assert g.outputs[0].token_ids == c.outputs[0].token_ids
        for lg, lc in zip(g.outputs[0].logprobs, c.outputs[0].logprobs):
            assert lg.top_token_ids == lc.top_token_ids
            assert abs(lg.token_logprob - lc.token_logprob) < 1e-3
