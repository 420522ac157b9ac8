"""The real model: SmolLM2-135M-Instruct from its GGUF file, greedy, against transformers on the same file: as
shipped (its Q8_0 and Q4_1 weights kept in their blocks, the quantized ops multiplying by them) and --dequantize
(float32 matrices, as transformers holds them)."""
import pytest
import torch

from devharness import LLM, SamplingParams


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three colors and explain why the sky is blue."}],
]


@pytest.fixture(scope="module")
def reference(smollm2_hf_model, smollm2_hf_tokenizer):
    tok, model = smollm2_hf_tokenizer, smollm2_hf_model
    prompts, outputs = [], []
    with torch.inference_mode():
        for conv in CONVERSATIONS:
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
            prompts.append(ids[0].tolist())
            outputs.append(out[0, ids.shape[1]:].tolist())
    return prompts, outputs, tok


@pytest.mark.parametrize("dequantize, kind", [(False, "as shipped"), (True, "dequantized")])
def test_smollm2_chat_greedy_matches_transformers(reference, dequantize, kind):
    ref_prompts, ref_outputs, ref_tok = reference
    with LLM("smollm2", dequantize=dequantize) as llm:
        assert llm.engine.core.weights.kind == kind   # as shipped unless asked: not dequantized behind our back
        ours = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(c), add_special_tokens=False)
                for c in CONVERSATIONS]
        assert ours == ref_prompts                      # same chat rendering and tokenization
        outs = llm.chat(CONVERSATIONS, SamplingParams(max_tokens=32, temperature=0))
    for out, ref in zip(outs, ref_outputs):
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == ref_tok.decode(ref, skip_special_tokens=True)
    assert "Paris" in outs[0].outputs[0].text
