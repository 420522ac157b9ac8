"""Greedy tokens of our engine against transformers' LlamaForCausalLM on the same checkpoint files."""
import pytest
import torch

from devharness import LLM, SamplingParams
from devharness.model.arch import RopeScaling
from devharness.model.builtin import TINY_ARCH, write_hf_checkpoint
from tests.helpers import as_inputs, mixed_prompts

import transformers


def reference_greedy(path, prompts, max_new_tokens, dtype=torch.float32):
    """transformers' generate, one prompt at a time (no padding), EOS not special."""
    model = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=dtype).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=TINY_ARCH.vocab_size - 1)
            outs.append(out[0, len(p):].tolist())
    return outs


def engine_greedy(path, prompts, max_new_tokens, **kw):
    with LLM(str(path), **kw) as llm:
        outs = llm.generate(as_inputs(prompts), SamplingParams(max_tokens=max_new_tokens, temperature=0,
                                                               ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_tiny_llama_matches_transformers_batched(tiny_hf_dir):
    prompts = mixed_prompts(10)   # 10 lengths from 1 to 64, all in one batch
    ref = reference_greedy(tiny_hf_dir, prompts, 32)
    got = engine_greedy(tiny_hf_dir, prompts, 32)
    assert got == ref
    # The synthetic model must not collapse into repeating one token, or this comparison proves little.
    assert all(len(set(toks)) > 8 for toks in ref)


@pytest.mark.parametrize("variant", ["tied", "llama3_rope", "linear_rope"])
def test_architecture_variants_match_transformers(tmp_path, variant):
    import msgspec
    changes = {
        "tied": dict(tie_word_embeddings=True),
        "llama3_rope": dict(rope_theta=500000.0, rope_scaling=RopeScaling(
            "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)),
        "linear_rope": dict(rope_scaling=RopeScaling("linear", factor=4.0)),
    }[variant]
    arch = msgspec.structs.replace(TINY_ARCH, **changes)
    path = write_hf_checkpoint(tmp_path / variant, arch=arch, seed=3)
    prompts = mixed_prompts(4, seed=5, lengths=(5, 40, 90, 130))
    assert engine_greedy(path, prompts, 16) == reference_greedy(path, prompts, 16)


def test_bfloat16_error_no_worse_than_transformers_bf16(tiny_hf_dir):
    """bf16 runs end to end, and its log-probabilities stray from the fp32 reference no more than
    transformers' own bf16 run strays (bf16 precision, not a bug, is all that separates them)."""
    prompt = mixed_prompts(1, seed=9, lengths=(40,))[0]

    def reference_logprobs(dtype):
        m = transformers.LlamaForCausalLM.from_pretrained(tiny_hf_dir, torch_dtype=dtype).eval()
        with torch.inference_mode():
            return torch.log_softmax(m(torch.tensor([prompt])).logits[0, -1].float(), -1)

    ref32, ref16 = reference_logprobs(torch.float32), reference_logprobs(torch.bfloat16)
    with LLM(str(tiny_hf_dir), dtype="bfloat16") as llm:
        out = llm.generate(as_inputs([prompt]), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                               logprobs=20))[0]
    c = out.outputs[0]
    assert len(c.token_ids) == 8
    ids = c.logprobs[0].top_token_ids
    ours_err = (torch.tensor(c.logprobs[0].top_logprobs) - ref32[ids]).abs().max().item()
    hf_err = (ref16[ids] - ref32[ids]).abs().max().item()
    assert ours_err <= 1.5 * hf_err + 0.05, (ours_err, hf_err)
    assert int(ref32.argmax()) in ids[:3]
