"""POST /start_profile and /stop_profile (server/profile_api.py, vLLM's routes), offered with --profiler-dir: a torch
profile over the requests between them writes one Chrome trace per rank there; a second start, or a stop with none
running, is a 409; a bad kind a 400 naming it; the requests go on meanwhile."""
import json
from pathlib import Path

import httpx
import pytest

# The server: tests/server/conftest.py's `profile_server`.


def complete(http):
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text
    return r


def test_a_torch_profile_over_http_writes_a_trace_in_the_profiler_dir(profile_server):
    url, folder = profile_server
    with httpx.Client(base_url=url, timeout=120) as http:
        r = http.post("/start_profile")
        assert r.status_code == 200 and r.json() == {"profiling": "torch"}, r.text
        again = http.post("/start_profile", json={"kind": "state-ab"})
        assert again.status_code == 409 and again.json()["error"]["code"] == "profile_running", again.text
        complete(http)
        r = http.post("/stop_profile")
        assert r.status_code == 200, r.text
        [result] = r.json()["results"]
        assert result["kind"] == "torch" and result["rank"] == 0 and result["steps"] >= 3
        trace = Path(result["trace"])
        assert trace.parent == folder and trace.exists()
        names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
        assert any(n.startswith("aten::") for n in names if n)
        none = http.post("/stop_profile")
        assert none.status_code == 409 and none.json()["error"]["code"] == "no_profile", none.text
        paths = http.get("/openapi.json").json()["paths"]
        for route in ("/start_profile", "/stop_profile"):
            assert {"200", "409", "503"} <= set(paths[route]["post"]["responses"]), route


def test_bad_kinds_are_a_400_naming_them_and_the_engine_goes_on(profile_server):
    url, _ = profile_server
    with httpx.Client(base_url=url, timeout=120) as http:
        r = http.post("/start_profile", json={"kind": "flame"})
        err = r.json()["error"]
        assert r.status_code == 400 and "'flame'" in err["message"] and err["param"] == "kind", r.text
        for body in ({"kind": 3}, {"kind": ""}, {"kind": "torch", "dir": "/etc"}):
            assert http.post("/start_profile", json=body).status_code == 400, body
        assert http.post("/stop_profile").status_code == 409   # none of them started one
        complete(http)
        r = http.post("/start_profile", json={"kind": "recorder-calls"})
        assert r.status_code == 200, r.text
        complete(http)
        [result] = http.post("/stop_profile").json()["results"]
        assert result["calls"]["end_step"]["calls"] == result["steps"] >= 3


def test_when_the_engine_thread_does_not_come_nothing_starts_then_or_later(monkeypatch):
    """While a step is held up (a rank paused or hung) the engine thread does not come within ENGINE_WAIT_S: the route
    answers 503, and what it asked for is withdrawn, so that the engine thread does not run it later either, once the
    step ends."""
    import asyncio
    from types import SimpleNamespace

    from devharness.server import profile_api
    from devharness.server.api import APIError
    from tests.engine.test_async_read import HeldEngine, held_front

    monkeypatch.setattr(profile_api, "ENGINE_WAIT_S", 0.2)
    engine, ran = HeldEngine(debug=True), []

    async def scenario():
        llm, stream = await held_front(engine)
        try:
            request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(llm=llm)))
            with pytest.raises(APIError) as e:
                await profile_api._between_steps(request, ran.append)
            assert e.value.status == 503 and e.value.code == "engine_busy"
            engine.hold.clear()
            engine.release.set()   # the engine thread comes after all
            assert await llm.inspect(lambda e: "between steps") == "between steps"
            stream.abort()
        finally:
            llm.shutdown()

    asyncio.run(scenario())
    assert ran == []
