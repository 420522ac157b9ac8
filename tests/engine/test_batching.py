"""Continuous batching must not change what any request produces."""
import pytest

from devharness import LLM, SamplingParams
from tests.helpers import as_inputs, mixed_prompts

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama") as llm:
        yield llm


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(32, seed=11)


@pytest.fixture(scope="module")
def alone(llm, prompts):
    return [llm.generate(as_inputs([p]), GREEDY)[0].outputs[0].token_ids for p in prompts]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batch_of_32_matches_each_alone(llm, prompts, alone):
    assert tokens(llm.generate(as_inputs(prompts), GREEDY)) == alone


def test_preemption_gives_the_same_tokens(prompts, alone):
    # 40 blocks of 16 tokens cannot hold 32 requests of up to 116 tokens: requests get preempted and recomputed.
    with LLM("tiny-llama", num_kv_blocks=40) as small:
        got = tokens(small.generate(as_inputs(prompts), GREEDY))
        assert small.stats()["num_preemptions"] > 0
    assert got == alone


def test_chunked_prefill_gives_the_same_tokens(prompts, alone):
    # A 24-token budget splits every long prompt into chunks spread over several steps.
    with LLM("tiny-llama", max_num_batched_tokens=24, max_num_seqs=5) as chunked:
        assert tokens(chunked.generate(as_inputs(prompts), GREEDY)) == alone


def test_seeded_sampling_is_independent_of_batch(llm, prompts):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    target = as_inputs(prompts[:1])
    first = tokens(llm.generate(target, params))
    again = tokens(llm.generate(target, params))
    others = [SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True) for i in range(8)]
    batched = tokens(llm.generate(as_inputs(prompts[5:13]) + target, others + [params]))[-1:]
    assert first == again == batched
    # And under preemption, in a fresh engine.
    with LLM("tiny-llama", num_kv_blocks=12) as small:
        squeezed = tokens(small.generate(as_inputs(prompts[5:13]) + target, others + [params]))[-1:]
        assert small.stats()["num_preemptions"] > 0
    assert squeezed == first
    # Sampling really samples: another seed takes another path.
    other_seed = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=99, ignore_eos=True)
    assert tokens(llm.generate(target, other_seed)) != first


def test_unseeded_sampling_reproducible_per_engine_seed(prompts):
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    runs = []
    for _ in range(2):
        with LLM("tiny-llama", seed=7) as llm:
            runs.append(tokens(llm.generate(as_inputs(prompts[:4]), params)))
    assert runs[0] == runs[1]


def test_prefix_caching_changes_no_output_and_skips_prefill(prompts):
    shared = mixed_prompts(1, seed=3, lengths=(80,))[0]            # five full blocks shared by every prompt
    inputs = as_inputs([shared + p[:7] for p in prompts[:6]])
    with LLM("tiny-llama", enable_prefix_caching=False) as plain:
        expected = tokens(plain.generate(inputs, GREEDY))
        computed_plain = plain.stats()["num_computed_tokens_total"]
    with LLM("tiny-llama") as cached:
        first = cached.generate(inputs[:1], GREEDY)
        rest = cached.generate(inputs[1:], GREEDY)
        stats = cached.stats()
    assert tokens(first + rest) == expected
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 80 for o in rest)
    assert stats["prefix_cache_hit_tokens"] == 5 * 80
    assert stats["num_computed_tokens_total"] == computed_plain - 5 * 80


def test_reset_prefix_cache_computes_prompts_seen_before_again(prompts):
    shared = mixed_prompts(1, seed=3, lengths=(80,))[0]
    inputs = as_inputs([shared + p[:7] for p in prompts[:3]])   # one step: the three are computed side by side
    with LLM("tiny-llama") as llm:
        first = tokens(llm.generate(inputs, GREEDY))
        assert llm.stats()["prefix_cache_hit_tokens"] == 0
        assert llm.reset_prefix_cache() is True
        again = llm.generate(inputs, GREEDY)
        assert tokens(again) == first and [o.num_cached_tokens for o in again] == [0, 0, 0]
        assert llm.stats()["prefix_cache_hit_tokens"] == 0
        cached = llm.generate(inputs, GREEDY)                      # no reset: each finds its five full blocks
        assert tokens(cached) == first and [o.num_cached_tokens for o in cached] == [80, 80, 80]
        assert llm.stats()["prefix_cache_hit_tokens"] == 3 * 80


def test_greedy_request_unaffected_by_sampled_neighbours(llm, prompts, alone):
    params = [GREEDY if i % 2 == 0 else SamplingParams(max_tokens=10, temperature=1.2, seed=i, ignore_eos=True)
              for i in range(16)]
    outs = tokens(llm.generate(as_inputs(prompts[:16]), params))
    assert [outs[i] for i in range(0, 16, 2)] == [alone[i] for i in range(0, 16, 2)]


def test_greedy_rows_take_their_tokens_without_the_logits(llm, prompts, alone, monkeypatch):
    """A step whose rows are all greedy takes each row's token from the linear_argmax op (whose fast kernel never
    writes the logits; DecoderForCausalLM.greedy_tokens); the same tokens as through the logits and the
    sampler, which a step with a row that wants logprobs still takes."""
    from devharness.model.decoder import DecoderForCausalLM
    fused, logits = [], []
    greedy_tokens, compute_logits = DecoderForCausalLM.greedy_tokens, DecoderForCausalLM.compute_logits
    monkeypatch.setattr(DecoderForCausalLM, "greedy_tokens",
                        lambda self, h: fused.append(out := greedy_tokens(self, h)) or out)
    monkeypatch.setattr(DecoderForCausalLM, "compute_logits",
                        lambda self, h: logits.append(len(h)) or compute_logits(self, h))
    assert tokens(llm.generate(as_inputs(prompts), GREEDY)) == alone
    assert fused and all(t is not None for t in fused) and not logits
    with_logprobs = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    out = llm.generate(as_inputs(prompts[:3]), [GREEDY, with_logprobs, GREEDY])
    assert tokens(out) == alone[:3] and logits and len(out[1].outputs[0].logprobs) == 16
    monkeypatch.setattr(DecoderForCausalLM, "greedy_tokens", lambda self, h: None)   # the logits' path
    logits.clear()
    assert tokens(llm.generate(as_inputs(prompts), GREEDY)) == alone and logits
