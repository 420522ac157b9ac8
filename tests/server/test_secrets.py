"""Secrets stay secret (debug/redact.py): a `devharness serve --debug` given an API key and a debug token shows neither
in any route's reply, in a rank's stacks (on uni rank 0 is the server, whose command line py-spy prints first), in a
worker's log, in a bundle's files or in its own output; and the bundle is its user's alone (0700, files 0600)."""
import io
import json
import stat
import tarfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

MASK = "<redacted>"


def leaks(s, text: str | bytes) -> list[str]:
    """Which of the server's secrets `text` holds."""
    data = text.encode() if isinstance(text, str) else text
    return [name for name, v in (("api key", s.key), ("debug token", s.token)) if v.encode() in data]


def client(s) -> httpx.Client:
    """Sends the debug token, the key under /v1."""
    def auth(request: httpx.Request) -> None:
        if request.url.path.startswith("/v1/"):
            request.headers["Authorization"] = f"Bearer {s.key}"
    return httpx.Client(base_url=s.url, timeout=120, headers={"Authorization": f"Bearer {s.token}"},
                        event_hooks={"request": [auth]})


def first_event(http: httpx.Client, path: str) -> bytes:
    with http.stream("GET", path) as r:
        assert r.status_code == 200
        data = b""
        for chunk in r.iter_bytes():
            data += chunk
            if b"\n\n" in data:
                return data
    raise AssertionError(f"{path}: no event")


def test_no_reply_shows_a_secret(secret_server):
    s = secret_server
    world = 1 if s.backend == "uni" else 2
    replies: dict[str, bytes] = {}
    with client(s) as http:
        done = http.post("/v1/completions", json={"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 4})
        assert done.status_code == 200, done.text
        replies["POST /v1/completions"] = done.content
        refused = httpx.post(s.url + "/v1/completions", json={}, headers={"Authorization": "Bearer wrong"})
        assert refused.status_code == 401
        replies["POST /v1/completions (wrong key)"] = refused.content
        paths = httpx.get(s.url + "/openapi.json", timeout=60).json()["paths"]
        gets = [p for p, ops in paths.items() if "get" in ops]
        assert {"/debug/workers", "/debug/workers/{rank}/stack", "/debug/workers/{rank}/logs"} <= set(gets), gets
        for path in gets:
            if path == "/debug/stream":
                replies[path] = first_event(http, path)
                continue
            if path == "/debug/bundle/{name}":   # test_a_bundle_shows_no_secret_and_is_its_users_alone
                continue
            if "{request_id}" in path:   # the completion above, from the requests the engine keeps a story of
                [story] = [r for r in http.get("/debug/requests").json()["requests"] if r["state"] == "finished"]
                path = path.replace("{request_id}", story["request_id"])
            assert "{" not in path.replace("{rank}", ""), f"{path}: a path parameter this test does not fill"
            for rank in range(world) if "{rank}" in path else [None]:
                got = path.replace("{rank}", str(rank))
                r = http.get(got)
                assert r.status_code == 200, (got, r.text)
                replies[got] = r.content
        for path in ("/debug/engine/pause", "/debug/engine/step", "/debug/engine/resume"):
            r = http.post(path)
            assert r.status_code == 200, (path, r.text)
            replies[path] = r.content
    for path, body in replies.items():
        assert not leaks(s, body), f"{path} shows the {leaks(s, body)}: {body[:2000]!r}"
    # py-spy really read every rank (the redaction, not an empty dump, keeps the secrets out) ...
    for rank in range(world):
        stacks = json.loads(replies[f"/debug/workers/{rank}/stack"])["stacks"]
        assert stacks.startswith("Process ") and "\nThread " in stacks, stacks[:2000]
    # ... and on uni what it printed first is the server's command line, with both values masked.
    if s.backend == "uni":
        head = json.loads(replies["/debug/workers/0/stack"])["stacks"].splitlines()[0]
        assert f"--api-key {MASK}" in head and f"--debug-token {MASK}" in head, head


def test_the_workers_inherit_no_secret(secret_server):
    """Given by $DEVHARNESS_API_KEY (mp), the key stays in the server: no worker process starts with it."""
    s = secret_server
    with client(s) as http:
        pids = [w["pid"] for w in http.get("/debug/workers").json()["workers"]]
    if s.backend == "uni":
        assert pids == [s.proc.pid]   # rank 0 is the server: no other process
        return
    assert len(pids) == 2 and s.proc.pid not in pids, pids
    for pid in pids:
        assert not leaks(s, Path(f"/proc/{pid}/environ").read_bytes()), f"worker pid {pid}'s environment"
        assert not leaks(s, "\0".join(psutil.Process(pid).cmdline())), f"worker pid {pid}'s command line"


def test_a_bundle_shows_no_secret_and_is_its_users_alone(secret_server):
    s = secret_server
    with client(s) as http:
        made = http.post("/debug/bundle")
        assert made.status_code == 200, made.text
        assert not leaks(s, made.content)
        body = made.json()
        tar = http.get(f"/debug/bundle/{body['name']}")
        assert tar.status_code == 200, tar.text
    d = Path(body["path"])
    assert d.parent == s.bundles
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    files = [p for p in d.rglob("*") if p.is_file()]
    assert {"bundle.json", "rank0/stacks.txt", "rank0/log.txt"} <= {str(p.relative_to(d)) for p in files}
    for p in [d, *d.rglob("*")]:
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p
    for p in files:
        assert not leaks(s, p.read_bytes()), f"{p.relative_to(d)} shows the {leaks(s, p.read_bytes())}"
    stacks = (d / "rank0" / "stacks.txt").read_text()
    assert "Thread " in stacks, stacks[:2000]
    if s.backend == "uni":
        assert f"--api-key {MASK}" in stacks.splitlines()[0], stacks[:2000]
    with tarfile.open(fileobj=io.BytesIO(tar.content), mode="r:gz") as t:
        members = [m for m in t.getmembers() if m.isfile()]
        assert len(members) == len(files)
        for m in members:
            assert not leaks(s, t.extractfile(m).read()), m.name


def test_the_servers_output_shows_no_secret(secret_server):
    """Last on this server: it is stopped, so that all it printed, to its end, is read."""
    s = secret_server
    s.proc.terminate()
    s.proc.wait(60)
    deadline = time.monotonic() + 30
    while "devharness: server stopped\n" not in s.lines and time.monotonic() < deadline:
        time.sleep(0.1)
    out = "".join(s.lines)
    assert "devharness: server stopped" in out and "serving tiny-llama" in out, out[-3000:]
    assert not leaks(s, out), f"the output shows the {leaks(s, out)}"
