"""SamplingParams holds only what the engine can carry to its workers (msgpack and int64 tensors
stop at 64 bits; NaN and Infinity sample nothing; a lone surrogate is no text): anything else is a
ValueError naming the field when the params are built, so LLM.generate never starts on them."""
import math

import msgspec
import pytest

from devharness import LLM, SamplingParams, config

I64_MIN, I64_MAX = -2**63, 2**63 - 1


@pytest.mark.parametrize("kwargs, field", [
    (dict(seed=I64_MAX + 1), "seed"), (dict(seed=2**64), "seed"), (dict(seed=I64_MIN - 1), "seed"),
    (dict(seed=2**200), "seed"), (dict(seed=1.5), "seed"), (dict(seed=True), "seed"),
    (dict(top_k=I64_MAX + 1), "top_k"), (dict(top_k=-1), "top_k"),
    (dict(stop_token_ids=[1, I64_MAX + 1]), "stop_token_ids"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(max_tokens=I64_MAX + 1), "max_tokens"), (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=math.nan), "temperature"), (dict(temperature=math.inf), "temperature"),
    (dict(temperature=10**400), "temperature"), (dict(temperature=-0.5), "temperature"),
    (dict(top_p=math.nan), "top_p"), (dict(top_p=math.inf), "top_p"), (dict(top_p=-math.inf), "top_p"),
    (dict(stop=["ok", "a\ud800b"]), "stop"), (dict(stop="\udfff"), "stop"), (dict(stop=[""]), "stop"),
    # What one request may ask for (config.py), as the server bounds it.
    (dict(stop=["a"] * (config.MAX_STOP_STRINGS + 1)), "stop"),
    (dict(stop=["a" * (config.MAX_STOP_STRING_CHARS + 1)]), "stop"),
    (dict(stop=["a" * config.MAX_STOP_STRING_CHARS]
          * (config.MAX_STOP_TOTAL_CHARS // config.MAX_STOP_STRING_CHARS + 1)), "stop"),
    (dict(stop_token_ids=[1] * (config.MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids"),
    (dict(logit_bias={t: 1.0 for t in range(config.MAX_LOGIT_BIAS + 1)}), "logit_bias"),
    (dict(logprobs=config.MAX_LOGPROBS + 1), "logprobs"),
    (dict(prompt_logprobs=config.MAX_LOGPROBS + 1), "prompt_logprobs"),
])
def test_out_of_bounds_is_a_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}=.*: "):
        SamplingParams(**kwargs)


def test_the_bounds_themselves_are_accepted():
    p = SamplingParams(seed=I64_MIN, top_k=I64_MAX, stop_token_ids=[0, I64_MAX], max_tokens=I64_MAX,
                       temperature=1e300, top_p=5e-324, stop=["é", "🦙"])
    assert p.seed == I64_MIN and p.top_k == I64_MAX and p.max_tokens == I64_MAX
    assert SamplingParams(seed=I64_MAX).seed == I64_MAX
    # the request bounds themselves, and the ValueError naming the limit past them
    p = SamplingParams(stop=["a" * config.MAX_STOP_STRING_CHARS] * (config.MAX_STOP_TOTAL_CHARS
                                                                    // config.MAX_STOP_STRING_CHARS),
                       stop_token_ids=[1] * config.MAX_STOP_TOKEN_IDS, logprobs=config.MAX_LOGPROBS,
                       logit_bias={t: 1.0 for t in range(config.MAX_LOGIT_BIAS)})
    assert len(p.logit_bias) == config.MAX_LOGIT_BIAS
    with pytest.raises(ValueError, match=f"at most {config.MAX_STOP_STRINGS} \\(MAX_STOP_STRINGS\\)"):
        SamplingParams(stop=["a"] * (config.MAX_STOP_STRINGS + 1))


def test_replace_and_decode_check_too():
    """msgspec runs the same checks when a SamplingParams is copied with a change or decoded."""
    with pytest.raises(ValueError, match="SamplingParams.seed"):
        msgspec.structs.replace(SamplingParams(), seed=2**64)
    with pytest.raises(msgspec.ValidationError, match="SamplingParams.top_k"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"top_k": I64_MAX + 1}), type=SamplingParams)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", max_model_len=128, threads_per_worker=1) as llm:
        yield llm


def test_generate_refuses_before_anything_runs(llm):
    with pytest.raises(ValueError, match="SamplingParams.seed"):
        llm.generate(["Hello"], SamplingParams(seed=2**64, max_tokens=4))
    # Checks that need the model: a stop token past the vocabulary, a prompt no tokenizer can take.
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(stop_token_ids=[264], max_tokens=4))
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["a\ud800b"], SamplingParams(max_tokens=4))
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and not llm.engine.has_unfinished_requests()
    # and the engine still generates, at the largest seed it can carry
    out = llm.generate(["Hello"], SamplingParams(seed=I64_MAX, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
