"""Bad requests get a 4xx in OpenAI's error shape, never FastAPI's {"detail": ...}, and the server
keeps serving: every case is followed by a good request."""
import json

import httpx
import pytest

from tests.server import UNI_SERVER

MODEL = UNI_SERVER["model"]
GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
TOO_LONG = 3000   # tokens, over tiny-llama's max_model_len of 2048


@pytest.fixture(scope="module")
def http(uni_server):
    """A client of the uni server that test_openai_api.py shares (tests/server/conftest.py)."""
    with httpx.Client(base_url=uni_server[0], timeout=60) as c:
        yield c


def with_(base, **changes):
    body = {**base, **changes}
    return {k: v for k, v in body.items() if v is not DROP}


DROP = object()

CASES = [
    # (route, body, status, code, param)
    ("/v1/completions", with_(GOOD, prompt=DROP), 400, "missing_required_parameter", "prompt"),
    ("/v1/chat/completions", with_(CHAT, messages=DROP), 400, "missing_required_parameter", "messages"),
    ("/v1/chat/completions", with_(CHAT, messages=[]), 400, "invalid_value", "messages"),
    ("/v1/chat/completions", with_(CHAT, messages=[{"role": "wizard", "content": "x"}]), 400, "invalid_type",
     "messages.0.role"),
    ("/v1/completions", with_(GOOD, max_tokens="ten"), 400, "invalid_type", "max_tokens"),
    ("/v1/completions", with_(GOOD, max_tokens=2.5), 400, "invalid_type", "max_tokens"),
    ("/v1/completions", with_(GOOD, temperature="hot"), 400, "invalid_type", "temperature"),
    ("/v1/completions", with_(GOOD, prompt=12), 400, "invalid_type", "prompt"),
    ("/v1/completions", with_(GOOD, prompt=[1, "two"]), 400, "invalid_type", "prompt"),
    ("/v1/completions", with_(GOOD, stream="yes"), 400, "invalid_type", "stream"),
    ("/v1/completions", with_(GOOD, max_tokens=-1), 400, "invalid_value", "max_tokens"),
    ("/v1/completions", with_(GOOD, max_tokens=0), 400, "invalid_value", "max_tokens"),
    ("/v1/completions", with_(GOOD, temperature=-0.5), 400, "invalid_value", "temperature"),
    ("/v1/chat/completions", with_(CHAT, temperature=-1), 400, "invalid_value", "temperature"),
    ("/v1/chat/completions", with_(CHAT, max_completion_tokens=-1), 400, "invalid_value", "max_completion_tokens"),
    ("/v1/completions", with_(GOOD, top_p=0), 400, "invalid_value", "top_p"),
    ("/v1/completions", with_(GOOD, logprobs=21), 400, "invalid_value", "logprobs"),
    ("/v1/completions", with_(GOOD, stop=[""]), 400, "invalid_value", "stop.0"),
    ("/v1/completions", with_(GOOD, prompt=""), 400, "invalid_prompt", "prompt"),
    ("/v1/completions", with_(GOOD, prompt=[]), 400, "invalid_prompt", "prompt"),
    ("/v1/completions", with_(GOOD, prompt=[1, 99999]), 400, "invalid_prompt", "prompt"),
    ("/v1/completions", with_(GOOD, prompt="x" * TOO_LONG), 400, "context_length_exceeded", "prompt"),
    ("/v1/completions", with_(GOOD, prompt=[65] * TOO_LONG), 400, "context_length_exceeded", "prompt"),
    ("/v1/completions", with_(GOOD, max_tokens=5000), 400, "context_length_exceeded", "max_tokens"),
    ("/v1/chat/completions", with_(CHAT, messages=[{"role": "user", "content": "x" * TOO_LONG}]), 400,
     "context_length_exceeded", "messages"),
    ("/v1/completions", with_(GOOD, model="gpt-4"), 404, "model_not_found", "model"),
    ("/v1/chat/completions", with_(CHAT, model="no-such-model"), 404, "model_not_found", "model"),
    ("/v1/completions", with_(GOOD, n=129), 400, "invalid_value", "n"),
    ("/v1/completions", with_(GOOD, prompt=["a"] * 65, n=2), 400, "invalid_value", "prompt"),
    ("/v1/chat/completions", with_(CHAT, n=0), 400, "invalid_value", "n"),
    ("/v1/completions", with_(GOOD, prompt=[[1, 2], "a"]), 400, "invalid_type", "prompt"),
    ("/v1/completions", with_(GOOD, prompt=[[1, 2], []]), 400, "invalid_prompt", "prompt"),
    ("/v1/completions", with_(GOOD, prompt=["a", ""]), 400, "invalid_prompt", "prompt"),
    ("/v1/completions", with_(GOOD, min_tokens=-1), 400, "invalid_value", "min_tokens"),
    ("/v1/completions", with_(GOOD, repetition_penalty=0), 400, "invalid_value", "repetition_penalty"),
    ("/v1/completions", with_(GOOD, prompt_logprobs=21), 400, "invalid_value", "prompt_logprobs"),
    ("/v1/completions", with_(GOOD, logit_bias={"264": 1}), 400, "invalid_value", "logit_bias"),
    ("/v1/completions", with_(GOOD, logit_bias={"5": 101}), 400, "invalid_value", "logit_bias.5"),
    ("/v1/completions", with_(GOOD, stream_options={"include_usage": "yes"}), 400, "invalid_type",
     "stream_options.include_usage"),
    ("/v1/chat/completions", with_(CHAT, chat_template_kwargs={"messages": []}), 400, "invalid_value",
     "chat_template_kwargs"),
    ("/v1/chat/completions", with_(CHAT, add_generation_prompt="no"), 400, "invalid_type", "add_generation_prompt"),
    ("/v1/completions", with_(GOOD, best_of=3), 400, "unsupported_parameter", None),
    ("/v1/completions", with_(GOOD, presence_penalty=0.5), 400, "unsupported_parameter", "presence_penalty"),
]


def check_error(r: httpx.Response, status: int, code: str | None = None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert isinstance(err["code"], str) and err["code"], err   # always a code, even where the test names none
    if code is not None:
        assert err["code"] == code, err
    return err


def check_still_serving(http):
    r = http.post("/v1/completions", json=GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("route, body, status, code, param", CASES,
                         ids=[f"{i}-{c[3]}-{c[4]}" for i, c in enumerate(CASES)])
def test_bad_body_is_4xx_in_openai_shape(http, route, body, status, code, param):
    err = check_error(http.post(route, json=body), status, code)
    assert err.get("param") == param
    check_still_serving(http)


@pytest.mark.parametrize("raw", [b"{bad json", b"", b"[1, 2]", b'"just a string"', b"\xff\xfe",
                                 b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}",   # past int()'s digit limit
                                 b'{"prompt": "hi", "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_malformed_json(http, raw):
    check_error(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)
    check_still_serving(http)


def test_ten_megabyte_body_is_413(http):
    big = json.dumps({**GOOD, "prompt": "a" * (10 * 1024 * 1024)}).encode()
    check_error(http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413,
                "request_too_large")

    def chunked():   # no Content-Length: the limit must hold while the body streams in
        yield big[:1024]
        for i in range(1024, len(big), 1024 * 1024):
            yield big[i:i + 1024 * 1024]
    check_error(http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"}), 413,
                "request_too_large")
    check_still_serving(http)


def test_unknown_route_and_method_use_openai_shape(http):
    check_error(http.get("/v1/nothing-here"), 404, "not_found")
    check_error(http.get("/v1/completions"), 405, "method_not_allowed")
    check_still_serving(http)


def test_bad_streaming_request_fails_before_the_stream_starts(http):
    r = http.post("/v1/completions", json=with_(GOOD, stream=True, max_tokens=-3))
    check_error(r, 400, "invalid_value")
    assert not r.headers["content-type"].startswith("text/event-stream")
    check_still_serving(http)
