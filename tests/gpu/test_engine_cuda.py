"""The engine on one GPU: greedy tokens equal to transformers' on the same checkpoint (both on the GPU), every
tensor of the model, its KV cache, each step's inputs and the sampler's on the GPU, seeded sampling that does
not depend on the batch there, and logprobs that agree with the CPU's."""
import pytest
import torch

from tests.gpu.cuda import require_gpus, step_tensors

require_gpus(1)

from devharness import LLM, SamplingParams   # noqa: E402
from devharness.model import sampler   # noqa: E402
from devharness.model.builtin import TINY_ARCH   # noqa: E402
from devharness.worker.model_runner import ModelRunner   # noqa: E402
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
    runner = llm.engine.core.executor.worker.runner
    off = {name: t.device for name, t in [*runner.model.named_parameters(), *runner.model.named_buffers()]
           if t.device != GPU}
    off.update({f"layer {i} {kind}": t.device for i, a in enumerate(runner.model.attention_layers())
                for kind, t in (("k_cache", a.k_cache), ("v_cache", a.v_cache)) if t.device != GPU})
    prepare, sample = ModelRunner.prepare_inputs, sampler.sample
    seen = {"steps": 0, "sampled": 0}

    def checked_prepare(self, so):
        inputs = prepare(self, so)
        seen["steps"] += 1
        off.update({f"step {so.step} {name}": t.device for name, t in step_tensors(inputs).items() if t.device != GPU})
        return inputs

    def checked_sample(logits, batch, argmax):
        tokens, logprobs = sample(logits, batch, argmax)
        seen["sampled"] += 1
        made = {"logits": logits, "tokens": tokens, "logprobs": logprobs}
        off.update({f"sample {seen['sampled']} {name}": t.device for name, t in made.items()
                    if t is not None and t.device != GPU})
        return tokens, logprobs

    monkeypatch.setattr(ModelRunner, "prepare_inputs", checked_prepare)
    monkeypatch.setattr("devharness.worker.model_runner.sample", checked_sample)
    prompts = [list(range(1, 40)), list(range(1, 33)) + [7, 7], [5]]   # chunks over cached blocks, decodes
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=8, temperature=0.7, top_k=20, top_p=0.9, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.0, seed=2, ignore_eos=True, logprobs=0)]
    llm.generate(as_inputs(prompts), params)
    assert seen["steps"] >= 8 and seen["sampled"] >= 8
    assert off == {}


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
