"""Schemathesis over /v1, from the server's own OpenAPI schema: requests that fit the schema
(positive) and requests that break it (negative: out-of-bound and 64-bit-plus integers, wrong
types, missing or unknown fields) never get a 5xx, every status is one the schema documents,
and negative requests are refused with a 4xx. The engine serves the same greedy tokens after."""
import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings

schemathesis = pytest.importorskip("schemathesis")

from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    status_code_conformance,
)

from tests.server import serve_in_thread  # noqa: E402

MODEL = "tiny-llama"
# Small, so that any max_tokens a positive request gets past the context check is cheap.
MAX_MODEL_LEN = 256
MAX_EXAMPLES = 40          # per operation and mode
GREEDY = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0,
          "ignore_eos": True, "return_token_ids": True}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def server():
    with serve_in_thread(MODEL, max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, threads_per_worker=1,
                         seed=0) as (url, _, _):
        yield url


def greedy_ids(url: str) -> list[int]:
    r = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_fuzz_v1_never_breaks_the_engine(server):
    url = server
    before = greedy_ids(url)
    schema = schemathesis.openapi.from_url(url + "/openapi.json").include(path_regex="^/v1/")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions"}
    seen: dict[str, set[int]] = {}
    for op in operations:
        # GET /v1/models takes nothing, so there is nothing to break: positive only.
        has_body = op.method.upper() == "POST"
        for mode in [m for m in schemathesis.GenerationMode if has_body or m.is_positive]:
            checks = CHECKS + ([negative_data_rejection] if mode.is_negative else [])

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
                      phases=[Phase.explicit, Phase.generate],   # no shrinking: each example is a request
                      suppress_health_check=list(HealthCheck))
            def run(case):
                response = case.call(base_url=url, timeout=60)
                seen.setdefault(f"{op.label} {mode.value}", set()).add(response.status_code)
                case.validate_response(response, checks=checks)

            run()
    # The run reached the engine (some 200s), and negative data was refused (400s), per operation.
    for op in operations:
        if op.method.upper() == "POST":
            assert 400 in seen[f"{op.label} negative"], seen
            assert 200 in seen[f"{op.label} positive"] | seen[f"{op.label} negative"], seen
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert greedy_ids(url) == before


def test_openapi_states_the_bounds_and_the_real_error_shape(server):
    doc = httpx.get(server + "/openapi.json", timeout=30).json()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    assert "422" not in str({path: list(ops[m]["responses"]) for path, ops in doc["paths"].items() for m in ops})
    err = schemas[schemas["ErrorResponse"]["properties"]["error"]["$ref"].rsplit("/", 1)[1]]
    assert set(err["required"]) == {"message", "type", "code"} and "param" in err["properties"]
    for route in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][route]["post"]["responses"]
        for status in ("400", "404", "413", "503"):
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
    assert bounds("CompletionRequest", "max_tokens") == (1, i32)
    assert bounds("CompletionRequest", "n") == (1, i32)
    assert bounds("ChatCompletionRequest", "max_completion_tokens") == (1, i32)
    assert bounds("ChatCompletionRequest", "top_logprobs") == (0, 20)
    bias = schemas["CompletionRequest"]["properties"]["logit_bias"]["anyOf"][0]["patternProperties"]
    assert list(bias.values()) == [{"type": "number", "minimum": -100, "maximum": 100}]
