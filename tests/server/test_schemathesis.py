"""Schemathesis over /v1 and /debug, from the server's own OpenAPI schema: requests that fit the schema
(positive) and requests that break it (negative: out-of-bound and 64-bit-plus integers, wrong types,
missing fields; unknown fields are let through, as vLLM does) never get a 5xx or hang, every status
is one the schema documents, every 4xx is in OpenAI's error shape, and negative requests are refused
with a 4xx; narrowed to one field at a time, the fuzz crosses the schema's bounds on what one request may ask
for (config.py's) and each is refused. The engine serves the same greedy tokens after."""
import copy
import time

import httpx
from hypothesis import HealthCheck, Phase, given, settings

import schemathesis

from devharness import config

from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    status_code_conformance,
)

# The servers: tests/server/conftest.py's `fuzz_server` and `fuzz_debug_server` (a short context, FUZZ_MAX_MODEL_LEN).
MODEL = "tiny-llama"
MAX_EXAMPLES = 40          # per operation and mode
GREEDY = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0,
          "ignore_eos": True, "return_token_ids": True}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance]
DEBUG_MAX_EXAMPLES = 30
# Generated requests, at least: 500 over /v1 and /debug together (each test counts its own).
V1_MIN_CASES, DEBUG_MIN_CASES = 150, 350
REQUEST_TIMEOUT_S = 60     # a request that takes longer counts as a hang


def greedy_ids(url: str) -> list[int]:
    r = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def check_error_shape(response) -> None:
    """A 4xx is OpenAI's {"error": {"message", "type", "code"}}, never FastAPI's {"detail": ...}."""
    if 400 <= response.status_code < 500:
        body = response.json()
        assert set(body) >= {"error"} and "detail" not in body, (response.status_code, body)
        err = body["error"]
        assert all(isinstance(err.get(k), str) and err[k] for k in ("message", "type", "code")), body


def breakable(op) -> bool:
    """Whether a request can break the operation's schema: one that takes nothing, or only a path
    parameter that may be any string, has nothing to break (negative mode finds no request to send)."""
    return bool(op.body or op.query) or any(p.definition.get("schema", {}).get("type") != "string"
                                             for p in op.path_parameters)


def fuzz(url: str, operations, max_examples: int, after=None, before=None,
         reject_negative: bool = True) -> tuple[dict[str, set[int]], int]:
    """Every operation, positive and (if its schema can be broken) negative; `before(case)` runs before each request,
    `after(case, response)` after it. Returns the statuses seen per "operation mode" and the number of requests
    sent. `reject_negative`: every negative case must be refused (off where the schema was narrowed below what the
    server takes, and `after` decides which must be)."""
    seen: dict[str, set[int]] = {}
    sent = 0
    for op in operations:
        for mode in [m for m in schemathesis.GenerationMode if breakable(op) or m.is_positive]:
            checks = CHECKS + ([negative_data_rejection] if mode.is_negative and reject_negative else [])

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                      phases=[Phase.explicit, Phase.generate],   # no shrinking: each example is a request
                      suppress_health_check=list(HealthCheck))
            def run(case):
                nonlocal sent
                t0 = time.monotonic()
                response = None
                if before is not None:
                    before(case)
                try:
                    response = case.call(base_url=url, timeout=REQUEST_TIMEOUT_S)
                finally:
                    sent += 1
                    if after is not None:
                        after(case, response)
                assert time.monotonic() - t0 < REQUEST_TIMEOUT_S
                seen.setdefault(f"{op.label} {mode.value}", set()).add(response.status_code)
                case.validate_response(response, checks=checks)
                check_error_shape(response)

            run()
    return seen, sent


def test_fuzz_v1_never_breaks_the_engine(fuzz_server):
    url = fuzz_server
    before = greedy_ids(url)
    schema = schemathesis.openapi.from_url(url + "/openapi.json").include(path_regex="^/v1/")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions"}
    seen, sent = fuzz(url, operations, MAX_EXAMPLES)
    # The run reached the engine (some 200s), and negative data was refused (400s), per operation.
    for op in operations:
        if op.method.upper() == "POST":
            assert 400 in seen[f"{op.label} negative"], seen
            assert 200 in seen[f"{op.label} positive"] | seen[f"{op.label} negative"], seen
    assert sent >= V1_MIN_CASES, sent
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert greedy_ids(url) == before


# An endless event stream by design (test_debug_api reads it), so no request to it ever completes.
NOT_FUZZED = {"GET /debug/stream"}


def test_fuzz_debug_routes_never_break_the_engine(fuzz_debug_server):
    """Whatever a request to /debug holds or arms is let go after it (breakpoints cleared, the engine
    resumed, paused ranks released), so each request meets a serving engine and none waits on another's
    breakpoint; the fuzz itself shows that no request is a 5xx or hangs and every 4xx is OpenAI's shape."""
    url = fuzz_debug_server
    before = greedy_ids(url)
    schema = schemathesis.openapi.from_url(url + "/openapi.json").include(path_regex="^/debug/")
    operations = [op for op in (result.ok() for result in schema.get_all_operations()) if op.label not in NOT_FUZZED]
    labels = {op.label for op in operations}
    assert labels >= {"POST /debug/break", "POST /debug/engine/step", "GET /debug/workers/{rank}/logs"}, labels

    def let_go(case, response):
        label = case.operation.label
        if response is not None and response.status_code >= 400:
            return   # refused: nothing armed or held
        if label == "POST /debug/break":
            assert httpx.delete(url + "/debug/break", timeout=30).status_code == 200
        if label in ("POST /debug/engine/pause", "POST /debug/engine/step", "POST /debug/break"):
            assert httpx.post(url + "/debug/engine/resume", timeout=30).status_code == 200

    seen, sent = fuzz(url, operations, DEBUG_MAX_EXAMPLES, after=let_go)
    # Refused when broken, and done (a breakpoint armed, steps run) when not.
    for label in ("POST /debug/break", "POST /debug/engine/step"):
        assert 400 in seen[f"{label} negative"] and 200 in seen[f"{label} positive"], (label, seen)
    for label in ("stack", "logs", "history"):
        assert 400 in seen[f"GET /debug/workers/{{rank}}/{label} negative"], (label, seen)
        assert 404 in seen[f"GET /debug/workers/{{rank}}/{label} positive"], (label, seen)   # no such rank
        assert httpx.get(f"{url}/debug/workers/0/{label}", timeout=30).status_code == 200
    assert sent >= DEBUG_MIN_CASES, sent
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert greedy_ids(url) == before


def test_openapi_states_the_bounds_and_the_real_error_shape(fuzz_server):
    doc = httpx.get(fuzz_server + "/openapi.json", timeout=30).json()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    assert "422" not in str({path: list(ops[m]["responses"]) for path, ops in doc["paths"].items() for m in ops})
    err = schemas[schemas["ErrorResponse"]["properties"]["error"]["$ref"].rsplit("/", 1)[1]]
    assert set(err["required"]) == {"message", "type", "code"} and "param" in err["properties"]
    for route in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][route]["post"]["responses"]
        for status in ("400", "404", "408", "413", "503"):
            assert responses[status]["content"]["application/json"]["schema"] == \
                {"$ref": "#/components/schemas/ErrorResponse"}, (route, status)
        assert "text/event-stream" in responses["200"]["content"]
    assert "400" in doc["paths"]["/v1/models"]["get"]["responses"]

    def bounds(model, field):
        s = schemas[model]["properties"][field]
        for branch in s.get("anyOf", [s]):
            if branch.get("type") == "array":
                branch = branch["items"]
            if branch.get("type") == "integer":
                return branch.get("minimum"), branch.get("maximum")

    i32, i64 = 2**31 - 1, 2**63 - 1
    # exact integers: FastAPI's own rendering goes through floats, where 2**63 - 1 reads 2**63
    assert bounds("CompletionRequest", "seed") == (-2**63, i64)
    assert type(bounds("CompletionRequest", "seed")[1]) is int
    assert bounds("ChatCompletionRequest", "seed") == (-2**63, i64)
    assert bounds("CompletionRequest", "top_k") == (0, i32)
    assert bounds("CompletionRequest", "stop_token_ids") == (0, i32)
    assert bounds("CompletionRequest", "prompt") == (0, i32)
    assert bounds("CompletionRequest", "max_tokens") == (0, i32)   # 0 with echo: the prompt scored
    assert bounds("ChatCompletionRequest", "max_tokens") == (1, i32)
    assert bounds("CompletionRequest", "n") == (1, 128)
    assert bounds("ChatCompletionRequest", "min_tokens") == (0, i32)
    assert bounds("CompletionRequest", "prompt_logprobs") == (0, 20)
    assert bounds("ChatCompletionRequest", "max_completion_tokens") == (1, i32)
    assert bounds("ChatCompletionRequest", "top_logprobs") == (0, 20)
    bias = schemas["CompletionRequest"]["properties"]["logit_bias"]["anyOf"][0]["patternProperties"]
    assert list(bias.values()) == [{"type": "number", "minimum": -100, "maximum": 100}]

    def sizes(model, field, key):
        """The field's branches' `key` (maxItems, maxLength, maxProperties), as (branch type, value)."""
        s = schemas[model]["properties"][field]
        return sorted((b["type"], b[key]) for b in s.get("anyOf", [s]) if key in b)

    # What one request may ask for (config.py), stated where a client reads it; the fuzz draws within and past them.
    assert bounds("CompletionRequest", "logprobs") == (0, config.MAX_LOGPROBS)
    assert bounds("ChatCompletionRequest", "prompt_logprobs") == (0, config.MAX_LOGPROBS)
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        assert sizes(model, "stop", "maxItems") == [("array", config.MAX_STOP_STRINGS)]
        assert sizes(model, "stop", "maxLength") == [("string", config.MAX_STOP_STRING_CHARS)]
        stop_list = next(b for b in schemas[model]["properties"]["stop"]["anyOf"] if b["type"] == "array")
        assert stop_list["items"]["maxLength"] == config.MAX_STOP_STRING_CHARS
        assert sizes(model, "stop_token_ids", "maxItems") == [("array", config.MAX_STOP_TOKEN_IDS)]
        assert sizes(model, "logit_bias", "maxProperties") == [("object", config.MAX_LOGIT_BIAS)]
    # a batch of prompts (texts or token-id lists) holds at most MAX_CHOICES; one prompt's token ids are not capped
    assert sizes("CompletionRequest", "prompt", "maxItems") == [("array", config.MAX_CHOICES)] * 2


def past_bound(field: str, value) -> bool:
    """Whether `value` of `field` is past one of config.py's bounds on what a request may ask for."""
    if field == "stop":
        return isinstance(value, str) and len(value) > config.MAX_STOP_STRING_CHARS or isinstance(value, list) and (
            len(value) > config.MAX_STOP_STRINGS or any(isinstance(s, str) and len(s) > config.MAX_STOP_STRING_CHARS
                                                        for s in value))
    if field in ("logprobs", "prompt_logprobs"):
        return isinstance(value, int) and not isinstance(value, bool) and value > config.MAX_LOGPROBS
    limit = {"stop_token_ids": config.MAX_STOP_TOKEN_IDS, "logit_bias": config.MAX_LOGIT_BIAS,
             "prompt": config.MAX_CHOICES}[field]
    return isinstance(value, (list, dict)) and len(value) > limit and (
        field != "prompt" or all(isinstance(p, (str, list)) for p in value))   # a batch, not one prompt's ids


# The request bounds the fuzz aims at one by one, and how many examples each gets per mode.
BOUNDED_FIELDS = ("stop", "stop_token_ids", "prompt", "logprobs", "prompt_logprobs", "logit_bias")
BOUND_EXAMPLES = 25


def test_fuzz_request_bounds_one_field_at_a_time(fuzz_server):
    """The whole schema gives each field a few examples; here the schema is narrowed to one bounded field (the
    others left to their defaults, a prompt added), so that the negative mode breaks that field, its bound among
    its constraints: past-the-bound requests are sent and refused with a 400, within-bound ones are not a 5xx."""
    url = fuzz_server
    before_ids = greedy_ids(url)
    doc = httpx.get(url + "/openapi.json", timeout=30).json()
    refused_past: dict[str, int] = {}
    for field in BOUNDED_FIELDS:
        narrowed = copy.deepcopy(doc)
        narrowed["paths"] = {"/v1/completions": doc["paths"]["/v1/completions"]}
        request = narrowed["components"]["schemas"]["CompletionRequest"]
        request.pop("examples", None)
        # The field alone, and not null (the default it may take): what the negative mode breaks is its bound's branch.
        # The server still takes null, so a negative case is not refused for that alone: `count` holds past-the-bound
        # values to a 400, and nothing may be a 5xx.
        prop = request["properties"][field]
        request["properties"] = {field: {**prop, "anyOf": [b for b in prop["anyOf"] if b.get("type") != "null"]}
                                 if "anyOf" in prop else prop}
        if field == "prompt":
            request["required"] = ["prompt"]
        else:
            request.pop("required", None)
        operations = [r.ok() for r in schemathesis.openapi.from_dict(narrowed).get_all_operations()]

        def add_prompt(case, field=field):
            if isinstance(case.body, dict):
                if field != "prompt":
                    case.body["prompt"] = "Hi"
                case.body["max_tokens"] = 1

        def count(case, response, field=field):
            body = case.body if isinstance(case.body, dict) else {}
            if response is not None and past_bound(field, body.get(field)):
                assert response.status_code == 400, (field, response.text[:300])
                refused_past[field] = refused_past.get(field, 0) + 1

        fuzz(url, operations, BOUND_EXAMPLES, after=count, before=add_prompt, reject_negative=False)
    # Each count bound was crossed and refused, but logit_bias's: hypothesis does not build an object of 1025
    # properties that match a pattern (test_limits.py sends one); its negative cases here break its values and keys.
    # The integer bounds (logprobs, prompt_logprobs) are crossed in some runs and not in others (schemathesis picks
    # which constraint a negative case breaks: the type, the minimum or the maximum); whichever it sends past the
    # bound is held to a 400 above, and test_limits.py sends one of each.
    assert set(refused_past) >= {"stop", "stop_token_ids", "prompt"}, refused_past
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert greedy_ids(url) == before_ids
