"""Stop conditions: EOS, stop token ids, stop strings, max_tokens, max_model_len; and text streaming."""
import pytest

from devharness import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", max_model_len=64) as llm:
        yield llm


PROMPT = {"prompt_token_ids": [72, 101, 108, 108, 111]}


def reference(llm, n=24):
    return llm.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].outputs[0]


def test_stop_token_id_ends_at_its_first_occurrence(llm):
    ref = reference(llm)
    stop_tok = ref.token_ids[5]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_tok],
                                                ignore_eos=True))[0].outputs[0]
    first = ref.token_ids.index(stop_tok)
    assert out.token_ids == ref.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_eos_stops_unless_ignored(llm):
    eos = llm.engine.eos_token_ids[0]
    # Find a prompt whose greedy continuation contains EOS within 60 tokens.
    for start in range(256):
        p = {"prompt_token_ids": [start, 65, 66]}
        ref = llm.generate([p], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0].outputs[0]
        if eos in ref.token_ids:
            break
    else:
        pytest.skip("the synthetic model never emits EOS")  # pragma: no cover
    out = llm.generate([p], SamplingParams(max_tokens=60, temperature=0))[0].outputs[0]
    assert out.token_ids == ref.token_ids[:ref.token_ids.index(eos) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None


def test_stop_string_truncates_text(llm):
    ref = reference(llm)
    text = ref.text
    # A stop string from the middle of the reference text.
    candidates = [text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].isprintable()
                  and "\ufffd" not in text[i:i + 2]]
    stop = candidates[0]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, stop=[stop],
                                                ignore_eos=True))[0].outputs[0]
    assert out.text == text[:text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == ref.token_ids[:len(out.token_ids)] and len(out.token_ids) < 24


def test_max_tokens_and_max_model_len(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    long_prompt = {"prompt_token_ids": list(range(60))}
    out = llm.generate([long_prompt], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"     # 60 + 4 = max_model_len 64


def test_streamed_text_deltas_add_up(llm):
    engine = llm.engine
    rid = engine.add_request("Hello there", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == rid
            pieces.append(o.new_text)
            final = o
    assert "".join(pieces) == final.outputs[0].text
    assert final.outputs[0].text == llm.tokenizer.decode(final.outputs[0].token_ids)
