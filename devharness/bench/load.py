"""`devharness bench load`: many concurrent HTTP clients against a server, each sending a mix of
streaming and non-streaming completions, streams it leaves mid-way, and bad requests; prints the
requests completed and their latency (p50, p99). `run_load` is the load itself, for tests too.
Then, as guidellm reports them, time to first token and inter-token latency percentiles at a few
numbers of concurrent streams (`run_streams`), beside the output throughput."""
from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time

import msgspec

from devharness.bench.executor import positive_int
from devharness.bench.markdown import Table, add_flag, print_section

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


class StreamStats(msgspec.Struct):
    """`concurrency` clients streaming one request after another: each request's time to its first token, the gaps
    between the chunks that bring tokens (a chunk of k tokens counts as k gaps of a kth of its wait, as its usage
    says), and the tokens they all got."""
    concurrency: int
    ttft_s: list[float]
    itl_s: list[float]
    tokens: int
    wall_s: float
    failures: list[str]

    def row(self) -> str:
        def pct(values, q):
            return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000 if len(values) >= 2 else \
                (values[0] * 1000 if values else float("nan"))
        t, i = self.ttft_s, self.itl_s
        return (f"{self.concurrency:>7} {len(t):>8} {pct(t, 50):>8.1f} {pct(t, 90):>8.1f} {pct(t, 99):>8.1f} "
                f"{pct(i, 50):>8.1f} {pct(i, 90):>8.1f} {pct(i, 99):>8.1f} {self.tokens / self.wall_s:>9.1f}")


STREAMS_HEADER = (f"{'streams':>7} {'requests':>8} {'TTFT p50':>8} {'p90':>8} {'p99':>8} {'ITL p50':>8} {'p90':>8} "
                  f"{'p99':>8} {'tokens/s':>9}   (ms)")


async def run_streams(url: str, prompts: list[list[int]], *, concurrency: int, requests_per_stream: int,
                      max_tokens: int, model: str, timeout_s: float = 120.0, headers: dict | None = None) -> StreamStats:
    """`concurrency` clients, each streaming `requests_per_stream` greedy completions of `max_tokens` tokens in turn,
    with vLLM's continuous usage stats (the tokens each chunk brought)."""
    import httpx
    ttft, itl, failures = [], [], []
    tokens = 0

    async def client(i: int) -> None:
        nonlocal tokens
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s, headers=headers) as http:
            for j in range(requests_per_stream):
                body = {"model": model, "prompt": prompts[(i + j) % len(prompts)], "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
                t0 = last = time.perf_counter()
                seen = 0
                try:
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            failures.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                            continue
                        async for line in r.aiter_lines():
                            if not line.startswith("data: {"):
                                continue
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                failures.append(f"error event: {chunk['error']}")
                                break
                            count = chunk.get("usage", {}).get("completion_tokens", seen)
                            if not chunk["choices"] or count == seen:
                                continue
                            now = time.perf_counter()
                            if seen == 0:
                                ttft.append(now - t0)
                                itl.extend([0.0] * (count - 1))   # tokens that came with the first
                            else:
                                itl.extend([(now - last) / (count - seen)] * (count - seen))
                            last, seen = now, count
                except Exception as e:
                    failures.append(f"{type(e).__name__}: {e}")
                tokens += seen

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return StreamStats(concurrency, ttft, itl, tokens, time.perf_counter() - t0, failures)


def _stream_counts(text: str) -> list[int]:
    import argparse
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"expects integers >= 1 separated by commas (e.g. 1,8,32), not {text!r}")
    return counts


def register(sub) -> None:
    from devharness.engine.args import EngineArgs
    p = sub.add_parser("load", help="concurrent HTTP clients: completed requests, p50/p99 latency")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)
    p.add_argument("--url", default=None, help="load this server instead of starting one (--model names its model)")
    p.add_argument("--clients", type=positive_int, default=200)
    p.add_argument("--requests-per-client", type=positive_int, default=4)
    p.add_argument("--max-tokens", type=positive_int, default=16)
    p.add_argument("--num-prompts", type=positive_int, default=8)
    p.add_argument("--prompt-len", type=positive_int, default=24)
    p.add_argument("--streams", type=_stream_counts, default=[1, 8, 32],
                   help="concurrent streams to measure TTFT and inter-token latency at, e.g. 1,8,32")
    p.add_argument("--requests-per-stream", type=positive_int, default=4)
    add_flag(p)


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
        streams = [asyncio.run(run_streams(url, prompts, concurrency=c, requests_per_stream=args.requests_per_stream,
                                           max_tokens=args.max_tokens, model=args.model)) for c in args.streams]
    print(f"load: {args.clients} clients x {args.requests_per_client} requests, {args.max_tokens} tokens each")
    print(f"load: {result.summary()}")
    failed = [o for o in result.of("complete", "stream") if o.failure]
    if failed:
        print(f"load: {len(failed)} good requests failed, e.g. {failed[0].failure}")
    print(f"streams: each {args.requests_per_stream} greedy streaming requests of {args.max_tokens} tokens in turn")
    print(STREAMS_HEADER)
    for st in streams:
        print(st.row())
        if st.failures:
            print(f"streams: {len(st.failures)} requests failed at {st.concurrency} streams, e.g. {st.failures[0]}")
    if args.markdown:
        where = "a server of its own (uni executor)" if not args.url else "the server at --url"
        print_section(markdown_blocks(result, streams), note=f"{args.model}, {where}, {args.clients} clients x "
                                                             f"{args.requests_per_client} requests")
    return 1 if failed or any(st.failures for st in streams) else 0


def _pct(values: list[float], q: int) -> float:
    """The q-th percentile, in ms (as StreamStats.row and LoadResult.summary take them)."""
    if len(values) >= 2:
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000
    return values[0] * 1000 if values else float("nan")


def markdown_blocks(result: LoadResult, streams: list[StreamStats]) -> list:
    """docs/benchmarks.md's tables: the load's requests completed, latency and refusals; TTFT and ITL percentiles
    and output tokens/s at each number of concurrent streams."""
    good = result.of("complete", "stream")
    done = [o for o in good if o.failure is None]
    lat = result.latencies_s()
    p50, p99 = (statistics.quantiles(lat, n=100)[i] * 1000 for i in (49, 98)) if len(lat) >= 2 else (0.0, 0.0)
    refused = sum(1 for o in result.of("bad") if o.status is not None and 400 <= o.status < 500)
    load = Table(["", ""], [
        ["good requests completed", f"{len(done)}/{len(good)} in {result.wall_s:.1f} s ({len(done) / result.wall_s:.1f}/s)"],
        ["latency p50 / p99", f"{p50:.0f} ms / {p99:.0f} ms"],
        ["streams left mid-way / bad requests refused with a 4xx",
         f"{len(result.of('disconnect'))} / {refused} of {len(result.of('bad'))}"]])
    rows = []
    for st in streams:
        t, i = st.ttft_s, st.itl_s
        rows.append([str(st.concurrency), str(len(t)), " / ".join(f"{_pct(t, q):.0f}" for q in (50, 90, 99)),
                     " / ".join(f"{_pct(i, q):.1f}" for q in (50, 90, 99)), f"{st.tokens / st.wall_s:.0f}"])
    return [load, Table(["streams", "requests", "TTFT p50 / p90 / p99 (ms)", "ITL p50 / p90 / p99 (ms)",
                         "output tokens/s"], rows)]


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
    from devharness.server.app import build_app, uvicorn_config
    llm = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(args))
    try:
        sock = socket.create_server(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn_config(build_app(llm, max_pending_requests=max(1024, args.clients))))
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
