"""`devharness bench load`: many concurrent HTTP clients against a server, each sending a mix of
streaming and non-streaming completions, streams it leaves mid-way, and bad requests; prints the
requests completed and their latency (p50, p99). `run_load` is the load itself, for tests too."""
from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time

import msgspec

from devharness.bench.executor import positive_int

# What each client sends, in turn (client i starts at kind i): every fourth request is cut short or bad.
KINDS = ("complete", "stream", "complete", "disconnect", "stream", "bad", "complete", "stream")
# Requests the server must refuse with a 4xx (in OpenAI's shape); each names what is wrong with it.
BAD_BODIES = ({"max_tokens": 0}, {"temperature": -1}, {"min_tokens": -1}, {"prompt": None},
              {"model": "no-such-model"}, "{not json")


class Outcome(msgspec.Struct):
    """One request of the load."""
    kind: str
    prompt: int                       # index into the prompts
    status: int | None = None
    token_ids: list[int] | None = None   # a good request's tokens (streamed ones joined)
    error: dict | None = None         # a refused request's body
    latency_s: float | None = None
    failure: str | None = None        # what went wrong with a request that should have worked


class LoadResult(msgspec.Struct):
    outcomes: list[Outcome]
    wall_s: float

    def of(self, *kinds: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind in kinds]

    def latencies_s(self) -> list[float]:
        return sorted(o.latency_s for o in self.of("complete", "stream") if o.latency_s is not None)

    def summary(self) -> str:
        good = self.of("complete", "stream")
        done = [o for o in good if o.failure is None]
        lat = self.latencies_s()
        p50, p99 = (statistics.quantiles(lat, n=100)[i] * 1000 for i in (49, 98)) if len(lat) >= 2 else (0.0, 0.0)
        refused = sum(1 for o in self.of("bad") if o.status is not None and 400 <= o.status < 500)
        left = len(self.of("disconnect"))
        return (f"{len(done)}/{len(good)} good requests completed in {self.wall_s:.1f} s "
                f"({len(done) / self.wall_s:.1f}/s), latency p50 {p50:.0f} ms, p99 {p99:.0f} ms; "
                f"{left} streams left mid-way; {refused}/{len(self.of('bad'))} bad requests refused with a 4xx")


async def run_load(url: str, prompts: list[list[int]], *, clients: int, requests_per_client: int,
                   max_tokens: int, model: str, timeout_s: float = 120.0, headers: dict | None = None) -> LoadResult:
    """`clients` concurrent clients, each sending `requests_per_client` requests one after another."""
    import ssl

    import httpx
    tls = ssl.create_default_context()   # once: each client building its own costs more than its requests

    async def client(i: int) -> list[Outcome]:
        # A connection per client, reused at once: a shared pool would hand out connections that sat idle
        # past the server's keep-alive timeout, and lose a request to that race (a client-side artefact).
        out = []
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s, headers=headers, verify=tls) as http:
            for j in range(requests_per_client):
                kind, prompt = KINDS[(i + j) % len(KINDS)], (i + j) % len(prompts)
                body = {"model": model, "prompt": prompts[prompt], "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True}
                out.append(await _one(http, kind, prompt, body, i + j))
        return out

    t0 = time.perf_counter()
    per_client = await asyncio.gather(*(client(i) for i in range(clients)))
    wall_s = time.perf_counter() - t0
    return LoadResult([o for outs in per_client for o in outs], wall_s)


async def _one(http, kind: str, prompt: int, body: dict, n: int) -> Outcome:
    o = Outcome(kind, prompt)
    t0 = time.perf_counter()
    try:
        if kind == "complete":
            r = await http.post("/v1/completions", json=body)
            o.status = r.status_code
            if r.status_code == 200:
                o.token_ids = r.json()["choices"][0]["token_ids"]
        elif kind == "bad":
            bad = BAD_BODIES[n % len(BAD_BODIES)]
            kw = {"content": bad, "headers": {"Content-Type": "application/json"}} if isinstance(bad, str) \
                else {"json": {**body, **bad}}
            r = await http.post("/v1/completions", **kw)
            o.status, o.error = r.status_code, r.json()
        else:   # stream, or a stream the client leaves after its first token
            o.token_ids = []
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                o.status = r.status_code
                if r.status_code != 200:
                    await r.aread()
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            o.failure = f"error event: {chunk['error']}"
                            break
                        o.token_ids += chunk["choices"][0].get("token_ids") or []
                        if kind == "disconnect" and o.token_ids:
                            break      # leaving the block closes the connection mid-stream
    except Exception as e:   # a hang (timeout) or a dropped connection: the load goes on, the caller judges
        o.failure = f"{type(e).__name__}: {e}"
    o.latency_s = time.perf_counter() - t0
    if o.failure is None and kind in ("complete", "stream") and o.status != 200:
        o.failure = f"HTTP {o.status}"
    return o


def register(sub) -> None:
    from devharness.engine.args import EngineArgs
    p = sub.add_parser("load", help="concurrent HTTP clients: completed requests, p50/p99 latency")
    EngineArgs.add_cli_args(p)
    p.set_defaults(model="tiny-llama", func=run)
    p.add_argument("--url", default=None, help="load this server instead of starting one (--model names its model)")
    p.add_argument("--clients", type=positive_int, default=200)
    p.add_argument("--requests-per-client", type=positive_int, default=4)
    p.add_argument("--max-tokens", type=positive_int, default=16)
    p.add_argument("--num-prompts", type=positive_int, default=8)
    p.add_argument("--prompt-len", type=positive_int, default=24)


def run(args) -> int:
    import logging
    import random
    logging.getLogger("httpx").setLevel(logging.WARNING)   # a line per request otherwise
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 200) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    with _server(args) as url:
        load = dict(clients=args.clients, requests_per_client=args.requests_per_client,
                    max_tokens=args.max_tokens, model=args.model)
        asyncio.run(run_load(url, prompts, **{**load, "requests_per_client": 1}))   # warm-up
        result = asyncio.run(run_load(url, prompts, **load))
    print(f"load: {args.clients} clients x {args.requests_per_client} requests, {args.max_tokens} tokens each")
    print(f"load: {result.summary()}")
    failed = [o for o in result.of("complete", "stream") if o.failure]
    if failed:
        print(f"load: {len(failed)} good requests failed, e.g. {failed[0].failure}")
    return 1 if failed else 0


@contextlib.contextmanager
def _server(args):
    if args.url:
        yield args.url.rstrip("/")
        return
    import socket
    import threading

    import uvicorn

    from devharness.engine.args import EngineArgs
    from devharness.engine.async_llm import AsyncLLM
    from devharness.server.app import build_app
    llm = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args))
    try:
        sock = socket.create_server(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(build_app(llm, max_pending_requests=max(1024, args.clients)),
                                               log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the benchmark's server did not start")
            time.sleep(0.05)
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True
            thread.join(30)
            sock.close()
    finally:
        llm.shutdown()
