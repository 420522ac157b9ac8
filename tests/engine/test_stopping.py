"""Stop conditions: EOS, stop token ids, stop strings, max_tokens, max_model_len; and text streaming."""
import random

import pytest

from devharness import LLM, SamplingParams
from devharness.config import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from devharness.engine.stop_strings import StopMatcher


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


def naive_find(text: str, new_from: int, stops: list[str]):
    """vLLM's scan: each stop string looked for from where it would end past `new_from`; the first to start wins,
    the first listed of those starting there."""
    best = None
    for s in stops:
        j = text.find(s, max(0, new_from - len(s) + 1))
        if j != -1 and (best is None or j < best[0]):
            best = (j, s)
    return best


def test_stop_matcher_finds_what_the_naive_scan_finds():
    """Random texts fed in random pieces (a token's text each), random stop strings over a small alphabet (so that
    they overlap, repeat and straddle pieces): the matcher, given the whole text or only the tail it needs, finds
    what scanning every stop string finds."""
    rng = random.Random(0)
    alphabet = "ab c\né🦙"
    straddling = 0
    for _ in range(2000):
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 10))]
        matcher = StopMatcher(stops)
        text = ""
        while len(text) < 60:
            new_from = len(text)
            text += "".join(rng.choices(alphabet, k=rng.randint(0, 4)))
            expected = naive_find(text, new_from, stops)
            assert matcher.find(text, new_from) == expected, (text, new_from, stops)
            back = min(new_from, matcher.longest - 1)
            tail = matcher.find(text[new_from - back:], back)
            assert (tail and (tail[0] + new_from - back, tail[1])) == expected, (text, new_from, stops)
            if expected is not None:
                straddling += expected[0] < new_from
                break
    assert straddling > 100   # the random cases did test stop strings across pieces


def test_the_most_stop_strings_allowed_stop_where_the_naive_scan_does(llm):
    """MAX_STOP_STRINGS stop strings, up to MAX_STOP_STRING_CHARS long, one of them two tokens of the reference text
    (tiny-llama's tokens are bytes) and the rest nowhere in it: the text ends where the naive scan says."""
    ref = reference(llm)
    text = ref.text
    rng = random.Random(1)
    absent = []
    while len(absent) < MAX_STOP_STRINGS - 1:
        s = "".join(rng.choices("xyzXYZ", k=rng.randint(1, MAX_STOP_STRING_CHARS // 8)))
        if s not in text:
            absent.append(s)
    absent[-1] = "q" * MAX_STOP_STRING_CHARS if "q" * MAX_STOP_STRING_CHARS not in text else absent[-1]
    present = next(text[i:i + 2] for i in range(6, len(text) - 2) if text[i:i + 2].isprintable())
    stops = absent[:500] + [present] + absent[500:]
    assert len(stops) == MAX_STOP_STRINGS
    out = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, stop=stops, ignore_eos=True,
                                                include_stop_str_in_output=True))[0].outputs[0]
    j, s = naive_find(text, 0, stops)
    assert out.text == text[:j + len(s)] and out.stop_reason == s and out.finish_reason == "stop"
