"""Closed to strangers (server/auth.py): off loopback every /debug route needs the debug token (given or
generated), on loopback only when one is given; --api-key guards /v1 while /health and /metrics stay
open. A non-loopback bind is simulated by building the app with the host it would bind; it is served
on loopback. The /debug routes run over a fake monitor: what is tested is who may call them."""
import asyncio

import httpx
import pytest

from devharness.protocol.messages import Ledger, Snapshot
from devharness.debug.redact import MASK, redact
from devharness.server.app import banner, build_app
from devharness.server.auth import ServerAuth
from tests.server import serve_app

API_KEY = "sk-test-api-key"
OPEN = {"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
BODIES = {"/v1/completions": {"prompt": "Hi", "max_tokens": 2},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
          "/debug/engine/step": {"n": 1}, "/debug/break": {}, "/debug/release": {},
          "/start_profile": {"kind": "recorder-calls"}}


class FakeMonitor:
    """What the /debug routes ask of a WorkerMonitor, answered at once."""
    world_size = 1
    clock_offsets_ns: dict = {}

    def snapshot(self, engine):
        return Snapshot(engine=engine, workers=[])

    def paused_workers(self):
        return []

    def arm_breakpoint(self, spec):
        return [0]

    def release(self, rank=None):
        return {"released": []}

    def clear_breakpoints(self):
        return 0

    def stack(self, rank):
        return {"rank": rank, "stacks": ""}

    def logs(self, rank, lines):
        return []

    def history(self, rank):
        return []

    def collectives(self, rank, last=None):
        return Ledger(rank=rank)


@pytest.fixture(scope="module")
def llm(tiny_engine):
    return tiny_engine


@pytest.fixture
def bundle(llm, tmp_path, monkeypatch):
    """A bundle the server "wrote", so POST and GET /debug/bundle answer 200 without writing one."""
    path = tmp_path / "run-step1-requested"
    path.mkdir()
    (path / "bundle.json").write_text("{}")
    monkeypatch.setattr(llm.runner, "write_bundle", lambda reason="requested": str(path))
    monkeypatch.setattr(llm.runner.bundles, "paths", [path])
    return path.name


def call(http: httpx.Client, method: str, path: str, token: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    body = BODIES.get(path) if method in ("POST", "PUT", "PATCH") else None
    if path == "/debug/stream":   # endless: the status line is enough
        with http.stream(method, path, headers=headers) as r:
            if r.status_code != 200:
                r.read()
            return r
    return http.request(method, path, headers=headers, json=body)


def every_route(routes, prefix=""):
    """(path template, methods) of every route; newer FastAPIs include routers lazily: walk into them."""
    for route in routes:
        router = getattr(route, "original_router", None)
        if router is not None:
            yield from every_route(router.routes, prefix + getattr(route.include_context, "prefix", ""))
        else:
            yield prefix + route.path, getattr(route, "methods", None) or {"GET"}


def check_401(r: httpx.Response, code: str) -> None:
    assert r.status_code == 401, (r.request.url, r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == code and err["type"] == "invalid_request_error" and "Bearer" in err["message"]
    assert set(err) == {"message", "type", "code", "param"} and r.headers["www-authenticate"] == "Bearer"


def test_off_loopback_every_route_is_guarded_or_open_by_design(llm, bundle):
    app = build_app(llm, FakeMonitor(), host="0.0.0.0", api_key=API_KEY)
    token = app.state.auth.debug_token
    assert app.state.auth.debug_token_generated and len(token) >= 32
    guarded = {"/debug": ("invalid_debug_token", token), "/v1": ("invalid_api_key", API_KEY),
               "/start_profile": ("invalid_debug_token", token), "/stop_profile": ("invalid_debug_token", token)}
    seen = set()
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        # A finished request whose story /debug/requests/{request_id} tells.
        done = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                         headers={"Authorization": f"Bearer {API_KEY}"})
        assert done.status_code == 200, done.text
        stories = http.get("/debug/requests", headers={"Authorization": f"Bearer {token}"}).json()["requests"]
        request_id = next(r["request_id"] for r in stories if r["state"] == "finished")
        try:
            # Every route the app has, so a route added later cannot slip by unguarded.
            for template, methods in every_route(app.routes):
                if template in OPEN:
                    continue
                prefix = next((p for p in guarded if template == p or template.startswith(p + "/")), None)
                assert prefix, f"{template} is neither under a guarded prefix nor open by design"
                code, right = guarded[prefix]
                path = template.replace("{rank}", "0").replace("{name}", bundle).replace("{request_id}", request_id)
                other = guarded["/debug" if prefix == "/v1" else "/v1"][1]   # the right token, wrong place
                for method in sorted(methods - {"HEAD"}):
                    seen.add((method, template))
                    for wrong in (None, other):
                        check_401(call(http, method, path, wrong), code)
                    r = call(http, method, path, right)
                    assert r.status_code == 200, (method, path, r.text)
        finally:
            http.post("/debug/engine/resume", headers={"Authorization": f"Bearer {token}"})   # /engine/step paused it
        for wrong in (f"Bearer {token}x", f"Bearer {token[:-1]}", "Bearer", f"Basic {token}", f"Bearer {token} more"):
            check_401(http.get("/debug/workers", headers={"Authorization": wrong}), "invalid_debug_token")
        for path in ("/health", "/metrics"):
            assert http.get(path).status_code == 200
    assert {("GET", "/debug/workers"), ("POST", "/debug/engine/pause"), ("GET", "/debug/workers/{rank}/stack"),
            ("POST", "/debug/bundle"), ("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/start_profile"),
            ("POST", "/stop_profile")} <= seen
    assert len(seen) >= 15


def test_loopback_debug_needs_a_token_only_when_given(llm):
    with serve_app(build_app(llm, FakeMonitor())) as url, httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/debug/workers").status_code == 200
        assert http.get("/v1/models").status_code == 200
    app = build_app(llm, FakeMonitor(), host="::1", debug_token="my-token")
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        check_401(http.get("/debug/workers"), "invalid_debug_token")
        assert http.get("/debug/workers", headers={"Authorization": "bearer my-token"}).status_code == 200
        assert http.get("/v1/models").status_code == 200   # no --api-key: /v1 stays open


def test_api_key_guards_v1_only(llm):
    with serve_app(build_app(llm, api_key=API_KEY)) as url, httpx.Client(base_url=url, timeout=60) as http:
        check_401(http.get("/v1/models"), "invalid_api_key")
        check_401(http.post("/v1/completions", json=BODIES["/v1/completions"],
                            headers={"Authorization": "Bearer wrong"}), "invalid_api_key")
        ok = http.post("/v1/completions", json=BODIES["/v1/completions"], headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200 and ok.json()["choices"]
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        assert http.get("/debug/workers").status_code == 404   # no --debug: no debug routes
        assert http.post("/start_profile").status_code == 404   # nor the profiler's, without --profiler-dir
        schema = http.get("/openapi.json").json()
        assert "401" in schema["paths"]["/v1/completions"]["post"]["responses"]


def test_the_banner_prints_a_generated_token_once_and_a_given_one_never(llm):
    made = ServerAuth.for_bind("0.0.0.0", debug=True)
    text = banner(llm, ("0.0.0.0", 8000), made)
    assert text.count(made.debug_token) == 1 and "/v1 has no authentication" in text
    given = ServerAuth.for_bind("10.1.2.3", debug=True, api_key=API_KEY, debug_token="secret-of-mine")
    text = banner(llm, ("10.1.2.3", 8000), given)
    assert "secret-of-mine" not in text and API_KEY not in text and "warning" not in text
    assert ServerAuth.for_bind("127.0.0.1", debug=True).debug_token is None
    assert ServerAuth.for_bind("0.0.0.0", debug=False).debug_token is None   # no /debug routes to guard
    # The app's own tokens, a generated one too, are masked in stacks, logs and bundles from its start on.
    app = build_app(llm, FakeMonitor(), host="0.0.0.0", api_key="key-of-this-app")
    assert app.state.auth.debug_token_generated
    assert redact(f"{app.state.auth.debug_token} key-of-this-app") == f"{MASK} {MASK}"
    for bad in ("", "two words", "caf\u00e9"):
        with pytest.raises(ValueError, match="--api-key"):
            ServerAuth.for_bind("127.0.0.1", debug=False, api_key=bad)


def test_tui_client_sends_the_token_to_debug_and_the_key_to_v1():
    from devharness.tui.client import HttpDebugClient
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen[request.url.path] = request.headers.get("authorization")
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if request.url.path == "/v1/completions":
            return httpx.Response(200, json={"choices": [{"text": "x"}]})
        return httpx.Response(200, json={"released": []})

    async def run():
        client = HttpDebugClient("http://x:1", transport=httpx.MockTransport(handler), token="dbg", api_key="key")
        await client.release()
        await client.complete("hi", 1)
        await client.aclose()
    asyncio.run(run())
    assert seen == {"/debug/release": "Bearer dbg", "/v1/models": "Bearer key", "/v1/completions": "Bearer key"}


def test_bundle_cli_sends_its_token(llm, bundle, monkeypatch, capsys):
    from devharness.cli import main
    monkeypatch.delenv("DEVHARNESS_DEBUG_TOKEN", raising=False)
    app = build_app(llm, FakeMonitor(), host="0.0.0.0")
    with serve_app(app) as url:
        assert main(["bundle", "--url", url]) == 2
        assert "needs its debug token" in capsys.readouterr().err
        assert main(["bundle", "--url", url, "--token", app.state.auth.debug_token]) == 0
        assert bundle in capsys.readouterr().out
    # A token that starts with '-' (one a user chose; a generated one never does) is read as the flag's value.
    app = build_app(llm, FakeMonitor(), host="0.0.0.0", debug_token="-leading-dash")
    with serve_app(app) as url:
        assert main(["bundle", "--url", url, "--token", "-leading-dash"]) == 0
        assert bundle in capsys.readouterr().out


def test_a_generated_token_never_starts_with_a_dash():
    from devharness.server.auth import new_token
    # By construction (hex); the draws check it is still so, and that the token keeps its 256 bits.
    tokens = {new_token() for _ in range(2000)}
    assert len(tokens) == 2000
    assert all(len(t) == 64 and set(t) <= set("0123456789abcdef") for t in tokens)
    assert ServerAuth.for_bind("0.0.0.0", debug=True).debug_token[0] != "-"
