"""`devharness bench restart`: how long an engine with `restart_workers` takes from a SIGKILL of one worker to
serving again, beside how long the same engine took to start cold, in one run.

Each round SIGKILLs rank `--kill-rank` of an idle engine, then asks for the same greedy request every 50 ms
until one is answered (a client that honours Retry-After waits up to a second more). Times, from the SIGKILL:
detected (the engine says it is restarting), restarted (serving again), answered (that request's output,
checked against the tokens before the kill).
"""
from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time

from devharness.bench.executor import positive_int, ray_for
from devharness.bench.markdown import Table, add_flag, print_section, ratio


def register(sub) -> None:
    from devharness.engine.args import EngineArgs
    p = sub.add_parser("restart", help="time from SIGKILL of a worker to serving again (restart_workers)")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run, tp=2, executor="mp", threads_per_worker=1)
    p.add_argument("--rounds", type=positive_int, default=3, help="kills, one after another")
    p.add_argument("--kill-rank", type=int, default=1)
    add_flag(p)


def run(args) -> int:
    from devharness.engine.args import EngineArgs
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.restart_workers = True
    world = args.tp * args.pp
    if not 0 <= args.kill_rank < world:
        raise ValueError(f"--kill-rank {args.kill_rank}: ranks are 0..{world - 1}")
    if engine_args.distributed_executor_backend not in ("mp", "ray"):
        raise ValueError("--executor must be mp or ray: a uni worker runs in this process")
    with ray_for(world, args.executor == "ray", args.ray_address):
        rows = asyncio.run(_measure(engine_args, args.rounds, args.kill_rank, args.markdown))
    return 0 if rows else 1


def markdown_blocks(backend: str, cold_s: float, rows: list[dict]) -> list:
    """docs/benchmarks.md's table: the cold start, the median SIGKILL -> serving again with the rounds' range and
    when the death was seen, and the median against the cold start."""
    restarted = [r["restarted_s"] for r in rows]
    seen = [r["detected_s"] for r in rows if r["detected_s"] is not None]
    med = statistics.median(restarted)
    seen_words = f"; the death seen in {min(seen):.2f}–{max(seen):.2f} s" if seen else ""
    name = {"mp": "mp", "ray": "Ray"}.get(backend, backend)
    return [Table(["", "cold start", f"SIGKILL → serving again (median of {len(rows)})", "vs cold start"],
                  [[name, f"{cold_s:.2f} s", f"{med:.2f} s ({min(restarted):.2f}–{max(restarted):.2f} s{seen_words})",
                    ratio(med / cold_s)]])]


async def _measure(engine_args, rounds: int, kill_rank: int, markdown: bool = False) -> list[dict]:
    from devharness.engine.async_llm import AsyncLLM
    t0 = time.monotonic()
    llm = await asyncio.to_thread(AsyncLLM.from_engine_args, engine_args)
    cold_s = time.monotonic() - t0
    rows = []
    try:
        expected = await _answer(llm, "baseline")
        print(f"restart: {engine_args.model} tp={engine_args.tensor_parallel_size} pp={engine_args.pipeline_parallel_size} "
              f"{engine_args.distributed_executor_backend}; cold start {cold_s:.2f} s; killing rank {kill_rank}")
        for i in range(rounds):
            pid = llm.engine.workers.worker_pids[kill_rank]
            restarts = llm.stats()["restarts"]
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            detected = restarted = None
            answered = asyncio.ensure_future(_answer_when_ready(llm, f"round{i}"))
            while not answered.done():
                stats = llm.stats()
                if detected is None and (stats["state"] in ("restarting", "dead") or stats["restarts"] > restarts):
                    detected = time.monotonic() - killed
                if restarted is None and stats["restarts"] > restarts:
                    restarted = time.monotonic() - killed
                if stats["state"] == "dead":
                    raise RuntimeError(f"the restart failed: {llm.dead_error}")
                await asyncio.sleep(0.01)
            tokens = await answered
            row = {"detected_s": detected, "restarted_s": restarted or time.monotonic() - killed,
                   "answered_s": time.monotonic() - killed, "same_tokens": tokens == expected}
            rows.append(row)
            print(f"  round {i + 1}: detected {row['detected_s']:.2f} s, serving again {row['restarted_s']:.2f} s, "
                  f"answered {row['answered_s']:.2f} s after the SIGKILL; same tokens: {row['same_tokens']}")
    finally:
        await asyncio.to_thread(llm.shutdown)
    med = statistics.median(r["restarted_s"] for r in rows)
    print(f"restart: median SIGKILL -> serving again {med:.2f} s = {med / cold_s:.2f}x the cold start "
          f"({cold_s:.2f} s); tokens unchanged in {sum(r['same_tokens'] for r in rows)}/{len(rows)} rounds")
    if markdown:
        print_section(markdown_blocks(engine_args.distributed_executor_backend, cold_s, rows),
                      note=f"{engine_args.model} tp={engine_args.tensor_parallel_size} "
                           f"pp={engine_args.pipeline_parallel_size}, rank {kill_rank} killed")
    return rows


async def _answer(llm, request_id: str) -> list[int]:
    from devharness.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = None
    async for out in llm.generate({"prompt_token_ids": [5, 17, 99, 3, 42, 8, 120]}, params, request_id):
        pass
    return list(out.outputs[0].token_ids)


async def _answer_when_ready(llm, request_id: str) -> list[int]:
    from devharness.engine.async_llm import EngineDeadError
    attempt = 0
    while True:
        attempt += 1
        try:
            return await _answer(llm, f"{request_id}-{attempt}")
        except EngineDeadError:   # restarting (or not yet known dead when it went in)
            if llm.dead_error is not None:
                raise
            await asyncio.sleep(0.05)
