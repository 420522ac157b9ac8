"""The request dialect engine developers' clients speak (vLLM's OpenAI server): its sampling and streaming
extensions, unknown fields ignored with a warning and a header, prompt batches and n > 1, echo and prompt
logprobs. References: transformers (LlamaForCausalLM, its logits processors and its tokenizer) on the tiny
model written as a Hugging Face checkpoint, and the server's own single-prompt answers for batches."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from devharness.server.api import IGNORED_FIELDS_HEADER

EOS = 257
PROMPT_IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
# Greedy, this prompt's third token is EOS (the reference fixture checks that it still is).
EOS_EARLY = [256, 163, 65, 66]


@pytest.fixture(scope="module")
def http(dialect_server):
    return dialect_server[0]


@pytest.fixture(scope="module")
def hf(tiny_hf_dir):
    import transformers
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_hf_dir)
    return model, tokenizer


def hf_generate(hf, ids: list[int], n: int, **kw) -> list[int]:
    """transformers' greedy tokens after `ids`; EOS ends them only where kw names it."""
    model, _ = hf
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, **{"eos_token_id": None, **kw})
    return out[0, len(ids):].tolist()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of `ids` ([len, vocab])."""
    model, _ = hf
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"temperature": 0, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def events(http, route: str, **body) -> list[dict]:
    with http.stream("POST", route, json={"stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# -- unknown fields -------------------------------------------------------------------------------------

def test_unknown_fields_are_ignored_with_one_warning_and_a_header(http, caplog):
    body = {"prompt": PROMPT_IDS, "max_tokens": 4, "ignore_eos": True}
    want = complete(http, **body)["choices"][0]["token_ids"]
    with caplog.at_level(logging.WARNING, logger="devharness.server.api"):
        r = http.post("/v1/completions", json={**body, "temperature": 0, "return_token_ids": True, "max_tokenz": 3,
                                               "guided_json": {"x": 1}, "stream_options": {"frobnicate": True}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    assert r.headers[IGNORED_FIELDS_HEADER] == "max_tokenz, guided_json, stream_options.frobnicate"
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warnings) == 1 and "max_tokenz, guided_json, stream_options.frobnicate" in warnings[0], warnings
    # Streamed and chat alike; a request without unknown fields gets no header.
    with http.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                           "max_tokens": 2, "stream": True, "foo": 1}) as s:
        assert s.status_code == 200 and s.headers[IGNORED_FIELDS_HEADER] == "foo"
    assert IGNORED_FIELDS_HEADER not in http.post("/v1/completions", json=body).headers
    # A known field's bad value is still refused, unknown fields beside it or not.
    r = http.post("/v1/completions", json={**body, "max_tokens": -1, "foo": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


# -- sampling extensions against transformers' logits processors ------------------------------------------

def test_min_tokens_masks_eos_as_transformers_min_new_tokens(http, hf):
    plain = hf_generate(hf, EOS_EARLY, 8)
    assert EOS in plain[:3], f"the reference no longer emits EOS early: {plain}"
    got = complete(http, prompt=EOS_EARLY, max_tokens=12)["choices"][0]
    assert got["token_ids"] == plain[:plain.index(EOS) + 1] and got["finish_reason"] == "stop"
    want = hf_generate(hf, EOS_EARLY, 12, eos_token_id=EOS, min_new_tokens=6)
    got = complete(http, prompt=EOS_EARLY, max_tokens=12, min_tokens=6)["choices"][0]
    assert got["token_ids"] == want[:len(got["token_ids"])] and len(got["token_ids"]) >= 6
    assert EOS not in got["token_ids"][:6]
    # stop_token_ids are held back too (vLLM): the early token may not end it before min_tokens.
    early = plain[0]
    got = complete(http, prompt=EOS_EARLY, max_tokens=6, min_tokens=6, stop_token_ids=[early], ignore_eos=True)
    assert len(got["choices"][0]["token_ids"]) == 6


def test_repetition_penalty_and_logit_bias_match_transformers(http, hf):
    plain = hf_generate(hf, PROMPT_IDS, 10)
    want = hf_generate(hf, PROMPT_IDS, 10, repetition_penalty=1.8)
    assert want != plain   # the penalty changes something here, or this test would prove nothing
    got = complete(http, prompt=PROMPT_IDS, max_tokens=10, ignore_eos=True, repetition_penalty=1.8)
    assert got["choices"][0]["token_ids"] == want
    bias = {plain[1]: -6.0, 65: 4.0}
    want = hf_generate(hf, PROMPT_IDS, 10, sequence_bias={(t,): b for t, b in bias.items()})
    assert want != plain
    got = complete(http, prompt=PROMPT_IDS, max_tokens=10, ignore_eos=True,
                   logit_bias={str(t): b for t, b in bias.items()}, logprobs=1)["choices"][0]
    assert got["token_ids"] == want
    # Logprobs are the model's own, before the bias (as vLLM's): those of transformers' unbiased logits.
    ref = hf_logprobs(hf, PROMPT_IDS + want)
    for i, (t, lp) in enumerate(zip(want, got["logprobs"]["token_logprobs"])):
        assert lp == pytest.approx(ref[len(PROMPT_IDS) - 1 + i, t].item(), abs=1e-4)


def test_stop_string_and_stop_token_kept_with_include_stop_str_in_output(http):
    ref = complete(http, prompt=PROMPT_IDS, max_tokens=16, ignore_eos=True)["choices"][0]
    text = ref["text"]
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2)
                if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2])
    cut = text.index(stop)
    for include, want in ((False, text[:cut]), (True, text[:cut + len(stop)])):
        got = complete(http, prompt=PROMPT_IDS, max_tokens=16, ignore_eos=True, stop=[stop],
                       include_stop_str_in_output=include)["choices"][0]
        assert got["text"] == want and got["finish_reason"] == "stop"
    tok = ref["token_ids"][4]
    first = ref["token_ids"].index(tok)
    for include in (False, True):
        got = complete(http, prompt=PROMPT_IDS, max_tokens=16, ignore_eos=True, stop_token_ids=[tok],
                       include_stop_str_in_output=include)["choices"][0]
        assert got["token_ids"] == ref["token_ids"][:first + 1]
        shown = got["token_ids"] if include else got["token_ids"][:-1]
        assert got["text"] == complete(http, prompt=PROMPT_IDS, max_tokens=len(shown), ignore_eos=True)[
            "choices"][0]["text"] if shown else got["text"] == ""


def test_special_tokens_decoded_as_transformers_does(http, hf):
    _, tokenizer = hf
    plain = hf_generate(hf, EOS_EARLY, 8)
    for skip in (True, False):
        for spaces in (True, False):
            got = complete(http, prompt=EOS_EARLY, max_tokens=8, ignore_eos=True, skip_special_tokens=skip,
                           spaces_between_special_tokens=spaces)["choices"][0]
            assert got["token_ids"] == plain
            # (a stream's text holds back a last incomplete UTF-8 character, where decode gives U+FFFD)
            assert got["text"] == tokenizer.decode(plain, skip_special_tokens=skip,
                                                   spaces_between_special_tokens=spaces).rstrip("\ufffd")
    assert "</s>" in got["text"] or tokenizer.decode([EOS]) in got["text"]


def test_chat_template_options_match_transformers(http, hf):
    _, tokenizer = hf
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    for body, agp in (({}, True), ({"add_generation_prompt": False}, False),
                      ({"chat_template_kwargs": {"add_generation_prompt": False}}, False)):
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "return_token_ids": True,
                                                    **body})
        assert r.status_code == 200, r.text
        want = tokenizer.apply_chat_template(messages, add_generation_prompt=agp, tokenize=False)
        assert r.json()["choices"][0]["prompt_token_ids"] == tokenizer(want, add_special_tokens=False).input_ids


def test_continuous_usage_stats_count_what_was_sent(http):
    for route, body in (("/v1/completions", {"prompt": PROMPT_IDS}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        chunks = events(http, route, **body, max_tokens=7, n=2, ignore_eos=True, return_token_ids=True,
                        temperature=0, stream_options={"include_usage": True, "continuous_usage_stats": True})
        final = chunks[-1]
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 14
        sent = {0: 0, 1: 0}
        for c in chunks[:-1]:
            assert len(c["choices"]) == 1, c
            index = c["choices"][0]["index"]
            sent[index] += len(c["choices"][0].get("token_ids", []))
            u = c["usage"]
            assert u["completion_tokens"] == sent[index], c
            assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert sent == {0: 7, 1: 7}
        assert u["prompt_tokens"] == final["usage"]["prompt_tokens"]   # both choices share the one prompt
        # Without continuous_usage_stats (or without include_usage, as in vLLM) no chunk has usage.
        plain = events(http, route, **body, max_tokens=3, stream_options={"continuous_usage_stats": True})
        assert not any("usage" in c for c in plain)


# -- prompt batches and n > 1 ------------------------------------------------------------------------------

def test_a_batch_of_prompts_gives_each_the_text_it_gets_alone(http):
    prompts = ["The capital of France", [256, 77, 78, 79, 80, 81], "A", [256, 163, 65, 66]]
    alone = [complete(http, prompt=p, max_tokens=8, ignore_eos=True)["choices"][0] for p in prompts]
    texts = ["The capital of France", "x", "A", "y"]
    for batch in ([texts[0], texts[2]], [prompts[1], prompts[3]]):   # a batch of texts, a batch of token ids
        ref = [alone[prompts.index(p)] for p in batch]
        r = complete(http, prompt=batch, max_tokens=8, ignore_eos=True)
        assert [c["index"] for c in r["choices"]] == [0, 1]
        assert [(c["text"], c["token_ids"]) for c in r["choices"]] == [(c["text"], c["token_ids"]) for c in ref]
        assert r["usage"]["prompt_tokens"] == sum(len(c["prompt_token_ids"]) for c in ref)
        assert r["usage"]["completion_tokens"] == 16
    # Streamed, with n = 2 each: choice index = prompt * n + sample (OpenAI's numbering); greedy samples agree.
    chunks = events(http, "/v1/completions", prompt=[texts[0], texts[2]], n=2, max_tokens=8, ignore_eos=True,
                    temperature=0)
    got = {}
    for c in chunks:
        for ch in c["choices"]:
            got[ch["index"]] = got.get(ch["index"], "") + ch["text"]
    assert got == {0: alone[0]["text"], 1: alone[0]["text"], 2: alone[2]["text"], 3: alone[2]["text"]}


def sampled(http, route, **body) -> list[list[int]]:
    r = http.post(route, json={"temperature": 1.0, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True,
                               **body})
    assert r.status_code == 200, r.text
    return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": PROMPT_IDS}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_n_choices_with_a_seed_reproduce_and_differ(http, route, body):
    first = sampled(http, route, **body, n=3, seed=1234)
    assert len(first) == 3 and len({tuple(c) for c in first}) == 3   # each choice its own random stream
    assert sampled(http, route, **body, n=3, seed=1234) == first
    # Choice j draws as a single request with seed + j does (vLLM's rule), and streaming draws the same.
    assert [sampled(http, route, **body, seed=1234 + j)[0] for j in range(3)] == first
    streamed = {}
    for c in events(http, route, **body, n=3, seed=1234, temperature=1.0, max_tokens=12, ignore_eos=True,
                    return_token_ids=True):
        for ch in c["choices"]:
            streamed.setdefault(ch["index"], []).extend(ch.get("token_ids", []))
    assert [streamed[i] for i in range(3)] == first
    assert sampled(http, route, **body, n=3, seed=99) != first


# -- echo and prompt logprobs --------------------------------------------------------------------------------

LONG_PROMPT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs."


def test_echo_logprobs_match_transformers_with_max_tokens_zero(http, hf, monkeypatch):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0, a prompt longer than a step (chunked), each
    chunk's logits computed a few rows at a time (the worker runs in this process)."""
    from devharness.worker import model_runner
    monkeypatch.setattr(model_runner, "PROMPT_LOGITS_ROWS", 5)
    for _ in range(2):   # the second time its blocks are in the prefix cache: still every token scored
        r = complete(http, prompt=LONG_PROMPT, max_tokens=0, echo=True, logprobs=3)
        choice = r["choices"][0]
        ids = choice["prompt_token_ids"]
        assert len(ids) > 40 and choice["token_ids"] == [] and choice["finish_reason"] == "length"
        assert choice["text"] == LONG_PROMPT and r["usage"]["completion_tokens"] == 0
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = hf_logprobs(hf, ids)
        want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
        for i, top in enumerate(lp["top_logprobs"][1:], start=1):
            # keyed by text, as OpenAI's: byte tokens that decode alike (U+FFFD) share a key
            allowed = ref[i - 1].topk(3).values.tolist() + [want[i - 1]]
            assert all(any(v == pytest.approx(a, abs=1e-4) for a in allowed) for v in top.values()), (i, top)
            assert max(top.values()) == pytest.approx(allowed[0], abs=1e-4)


def test_prompt_logprobs_match_transformers_with_ranks(http, hf):
    r = complete(http, prompt=PROMPT_IDS, max_tokens=2, prompt_logprobs=2, ignore_eos=True)
    choice = r["choices"][0]
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(PROMPT_IDS) and plp[0] is None
    ref = hf_logprobs(hf, PROMPT_IDS)
    for i in range(1, len(PROMPT_IDS)):
        row, tok = ref[i - 1], PROMPT_IDS[i]
        entry = plp[i]
        assert entry[str(tok)]["logprob"] == pytest.approx(row[tok].item(), abs=1e-4)
        assert entry[str(tok)]["rank"] == int((row > row[tok]).sum()) + 1
        top = row.topk(2)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            if str(t) != str(tok) or rank == entry[str(tok)]["rank"]:
                assert entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-4)
                assert entry[str(t)]["rank"] == rank
    # Echo streamed: the first chunk carries the prompt, its logprobs and then the new tokens'.
    chunks = events(http, "/v1/completions", prompt=LONG_PROMPT, max_tokens=3, echo=True, logprobs=1, temperature=0,
                    ignore_eos=True)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text.startswith(LONG_PROMPT) and len(text) > len(LONG_PROMPT)
    lps = [x for c in chunks for x in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    assert lps[0] is None and len(lps) == len(plp_ids(http, LONG_PROMPT)) + 3
    # Chat: beside the choices, in the response and in the first chunk of a stream alike.
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 1}
    r = http.post("/v1/chat/completions", json={**body, "return_token_ids": True})
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    ids = r.json()["choices"][0]["prompt_token_ids"]
    assert len(plp) == len(ids) and plp[0] is None
    ref = hf_logprobs(hf, ids)
    assert [e[str(t)]["logprob"] for t, e in zip(ids[1:], plp[1:])] == pytest.approx(
        [ref[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4)
    streamed = [c["prompt_logprobs"] for c in events(http, "/v1/chat/completions", **body) if "prompt_logprobs" in c]
    assert len(streamed) == 1
    assert [e and {k: v["logprob"] for k, v in e.items()} for e in streamed[0]] == \
        [e and {k: pytest.approx(v["logprob"], abs=1e-5) for k, v in e.items()} for e in plp]


def plp_ids(http, prompt) -> list[int]:
    return complete(http, prompt=prompt, max_tokens=1)["choices"][0]["prompt_token_ids"]


# -- the request bodies of the clients engine developers use ---------------------------------------------------
# Each body is built as the client builds it (the source named beside it); none may be refused or have a field
# ignored.

def guidellm_completions(model, prompt, output_tokens):
    # guidellm (vllm-project/guidellm), src/guidellm/backends/openai/request_handlers.py,
    # TextCompletionsRequestHandler.format, streaming with a fixed output length ("stop": None is dropped)
    return {"model": model, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": output_tokens, "ignore_eos": True, "prompt": prompt}


def guidellm_chat(model, prompt, output_tokens):
    # guidellm, ChatCompletionsRequestHandler.format: one user message of text parts
    return {"model": model, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": output_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}]}


def vllm_bench_completions(model, prompt, output_len):
    # vLLM (vllm-project/vllm), vllm/benchmarks/lib/endpoint_request_func.py, async_request_openai_completions,
    # with `vllm bench serve --ignore-eos`
    return {"model": model, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": output_len, "logprobs": None,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


def vllm_bench_chat(model, prompt, output_len):
    # vLLM, async_request_openai_chat_completions
    return {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
            "max_completion_tokens": output_len, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}


def lm_eval_loglikelihood(model, token_prompts):
    # lm-eval (EleutherAI/lm-evaluation-harness), lm_eval/models/openai_completions.py,
    # LocalCompletionsAPI._create_payload(generate=False), tokenized requests batched
    return {"model": model, "prompt": token_prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}


def lm_eval_generate(model, token_prompts, until):
    # lm-eval, LocalCompletionsAPI._create_payload(generate=True)
    return {"prompt": token_prompts, "model": model, "max_tokens": 8, "temperature": 0, "stop": until, "seed": 1234}


@pytest.mark.parametrize("route, build", [("/v1/completions", guidellm_completions), ("/v1/chat/completions", guidellm_chat),
                                          ("/v1/completions", vllm_bench_completions),
                                          ("/v1/chat/completions", vllm_bench_chat)],
                         ids=["guidellm-completions", "guidellm-chat", "vllm-bench-completions", "vllm-bench-chat"])
def test_benchmark_clients_bodies(dialect_server, route, build):
    http, llm = dialect_server
    with http.stream("POST", route, json=build(llm.model_name, "The quick brown fox", 6)) as r:
        assert r.status_code == 200, r.read()
        assert IGNORED_FIELDS_HEADER not in r.headers
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert any(c["choices"] for c in chunks[:-1])   # the first choice chunk is the client's time to first token
    if "continuous_usage_stats" in build(llm.model_name, "", 1)["stream_options"]:
        assert all("usage" in c for c in chunks)


def test_lm_eval_bodies(dialect_server, hf):
    http, llm = dialect_server
    # Loglikelihood of a continuation: lm-eval sums token_logprobs[ctxlen:-1] (the last is the one sampled token)
    # and calls it greedy when each token's logprob is the top one.
    requests = [(PROMPT_IDS[:6], PROMPT_IDS[6:]), ([256, 84, 104, 101], [32, 113, 117, 105, 99, 107])]
    r = http.post("/v1/completions", json=lm_eval_loglikelihood(llm.model_name, [c + x for c, x in requests]))
    assert r.status_code == 200 and IGNORED_FIELDS_HEADER not in r.headers, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for (context, continuation), choice in zip(requests, choices):
        ids = context + continuation
        lps = choice["logprobs"]["token_logprobs"]
        assert len(lps) == len(ids) + 1
        got = sum(lps[len(context):-1])
        ref = hf_logprobs(hf, ids)
        want = sum(ref[i - 1, ids[i]].item() for i in range(len(context), len(ids)))
        assert got == pytest.approx(want, abs=1e-3)
        greedy = all(lp == max(top.values()) for lp, top in
                     zip(lps[len(context):-1], choice["logprobs"]["top_logprobs"][len(context):-1]))
        assert greedy == all(int(ref[i - 1].argmax()) == ids[i] for i in range(len(context), len(ids)))
    # generate_until: greedy, stopped at `until`, each prompt of the batch as alone.
    prompts = [PROMPT_IDS, [256, 84, 104, 101]]
    alone = [complete(http, prompt=p, max_tokens=8)["choices"][0]["text"] for p in prompts]
    until = [alone[0][3:5]] if len(alone[0]) > 5 else ["\n\n"]
    r = http.post("/v1/completions", json=lm_eval_generate(llm.model_name, prompts, until))
    assert r.status_code == 200 and IGNORED_FIELDS_HEADER not in r.headers, r.text
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert texts == [t[:t.index(until[0])] if until[0] in t else t for t in alone]


LM_EVAL_TASKS = Path(__file__).parent / "lm_eval_tasks"
# `lm_eval ARGS` as its console script runs it, with one difference: its task manager does not index lm-eval's own
# 14,000 built-in task files (16 s of CPU) before it runs the two of --include_path. What talks to the server (the
# local-completions model, its requests and retries) and what it writes are lm-eval's, unchanged.
LM_EVAL = """
import sys
from lm_eval.tasks import TaskManager
index_all = TaskManager.__init__

def index_included_only(self, *args, **kwargs):
    index_all(self, *args, **{**kwargs, "include_defaults": False})

TaskManager.__init__ = index_included_only
from lm_eval.__main__ import cli_evaluate
sys.argv[0] = "lm_eval"
cli_evaluate()
"""


def test_lm_eval_local_completions_runs_against_the_server(dialect_server, hf, tiny_hf_dir, tmp_path):
    """lm-eval itself (`lm_eval --model local-completions`, token-id prompts through the model's own tokenizer) on
    the repository's two local tasks: every loglikelihood it reports is transformers', its accuracy follows from
    them, and its generations are transformers' greedy text up to the stop string."""
    http, llm = dialect_server
    url = str(http.base_url).rstrip("/")
    out = tmp_path / "out"
    model_args = (f"model={llm.model_name},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={tiny_hf_dir},tokenized_requests=True,num_concurrent=2,max_retries=1")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", LM_EVAL, "--model", "local-completions", "--model_args", model_args,
                           "--tasks", "devharness_loglikelihood,devharness_generate", "--include_path", ".",
                           "--output_path", str(out), "--log_samples"],
                          cwd=LM_EVAL_TASKS, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]

    def samples(task):
        return [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]

    _, tokenizer = hf
    correct = []
    for s in samples("devharness_loglikelihood"):
        lls = []
        for args, (ll, is_greedy) in zip(s["arguments"].values(), s["filtered_resps"]):
            context = tokenizer(args["arg_0"], add_special_tokens=False).input_ids
            ids = tokenizer(args["arg_0"] + args["arg_1"], add_special_tokens=False).input_ids
            ref = hf_logprobs(hf, ids)
            want = sum(ref[i - 1, ids[i]].item() for i in range(len(context), len(ids)))
            assert float(ll) == pytest.approx(want, abs=1e-3), (s["doc"], args)
            assert (is_greedy == "True") == all(int(ref[i - 1].argmax()) == ids[i] for i in range(len(context), len(ids)))
            lls.append(want)
        correct.append(max(range(len(lls)), key=lls.__getitem__) == s["doc"]["answer"])
    assert len(correct) == 4
    assert results["devharness_loglikelihood"]["acc,none"] == pytest.approx(sum(correct) / len(correct))
    gens = samples("devharness_generate")
    assert len(gens) == 3
    for s in gens:
        ids = tokenizer(s["doc"]["question"], add_special_tokens=False).input_ids
        greedy = hf_generate(hf, ids, 8, eos_token_id=EOS)
        text = tokenizer.decode(greedy, skip_special_tokens=True).rstrip("\ufffd")
        assert s["filtered_resps"][0] == text.split("\n")[0], s


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them(tiny_hf_dir, tmp_path):
    """A template that reads a variable of its own (as Qwen3's reads enable_thinking): rendered as transformers
    renders it with the same keyword."""
    import shutil

    import transformers

    from devharness.model.tokenizer import Tokenizer
    path = tmp_path / "model"
    shutil.copytree(tiny_hf_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if greeting is defined %}{{ greeting }}\n{% endif %}{% for m in messages %}"
                               "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_hf_dir(path, bos_token_id=None, eos_token_ids=(EOS,))
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "Hi"}]
    for kwargs in ({}, {"greeting": "Hello there"}, {"greeting": "x", "add_generation_prompt": False}):
        want = theirs.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **kwargs})
        assert ours.apply_chat_template(messages, **{"add_generation_prompt": True, **kwargs}) == want
    assert "Hello there" in ours.apply_chat_template(messages, greeting="Hello there")
