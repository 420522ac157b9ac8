"""`devharness tui` against a live tp=2, pp=2 Ray debug server: the four workers laid out as the
topology, steps advancing while a request runs, p / s holding the engine, and b stopping rank 1
at a breakpoint (released through debugpy, as VS Code would, so the server can shut down).

Timeouts are generous and nothing asserts how long anything took: two shared cores run four Ray
workers, the server and the app at once."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import logging
import re
import threading

import httpx
import pytest

from devharness.config import DebugConfig
from devharness.tui import app as tui_app
from devharness.tui.app import DebugTUI
from devharness.tui.client import HttpDebugClient
from devharness.tui.widgets import WorkerCell
from tests.debug.dap_client import DAPClient
from tests.helpers import free_port_base
from tests.server import serve_in_thread


SIZE = (200, 50)
# Long enough to outlast any test at a few tokens a second; 128 blocks of 16 hold 2,048 tokens.
MAX_TOKENS = 1900


@pytest.fixture(scope="module")
def server(ray_instance):
    """(url, debug port base) of one server for the whole module: starting four Ray workers is
    the slow part."""
    port_base = free_port_base()
    with serve_in_thread(tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="ray",
                         threads_per_worker=1, num_kv_blocks=128,
                         debug=DebugConfig(enabled=True, port_base=port_base)) as (url, llm, app):
        yield url, port_base


@contextlib.contextmanager
def generating(url: str):
    """A long streamed request in the background, so the engine keeps stepping. Leaving the
    block closes the stream, which aborts the request: the next test starts from an idle engine."""
    stop = threading.Event()

    def run():
        body = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=None) as r:
            for _ in r.iter_lines():   # a token an event, so stop is seen every step
                if stop.is_set():
                    return

    thread = threading.Thread(target=run, name="generating", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        # A test that failed while paused would leave the stream silent and the thread stuck.
        httpx.post(f"{url}/debug/engine/resume", timeout=30)
        thread.join(60)


def server_engine(url: str) -> dict:
    return httpx.get(f"{url}/debug/workers", timeout=30).json()["engine"]


async def until(pilot, condition, timeout_s: float = 60.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


def cell_text(app: DebugTUI, rank: int) -> str:
    return app.query_one(f"#rank-{rank}", WorkerCell).render().plain


def header(app: DebugTUI) -> str:
    return str(app.query_one("#engine-text").render())


def header_step(app: DebugTUI) -> int:
    return int(re.search(r"step (\d+)", header(app)).group(1))


def cell_step(app: DebugTUI, rank: int) -> int:
    return int(re.search(r"step (\d+)", cell_text(app, rank)).group(1))


@contextlib.asynccontextmanager
async def live_app_with_a_request(url: str):
    """The app on a server that is running a long request (so the engine keeps stepping)."""
    async with live_app(url) as (app, pilot):
        with generating(url):
            await until(pilot, lambda: app.snapshot.engine.num_running == 1, what="the request to start")
            yield app, pilot


@contextlib.asynccontextmanager
async def live_app(url: str):
    app = DebugTUI(HttpDebugClient(url))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.focused is not None and len(cells := app.query(WorkerCell)) == 4
                    and all(c.region.width for c in cells), what="the first snapshot laid out")
        yield app, pilot


async def test_live_topology(server):
    url, port_base = server
    async with live_app(url) as (app, pilot):
        cells = {c.state.rank: c for c in app.query(WorkerCell)}
        assert {r: (c.state.tp_rank, c.state.pp_rank) for r, c in cells.items()} == \
            {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1)}
        r0 = cells[0].region
        assert cells[1].region.x > r0.x and cells[1].region.y == r0.y      # tp across
        assert cells[2].region.x == r0.x and cells[2].region.y > r0.y      # pp down
        assert cells[3].region.x == cells[1].region.x and cells[3].region.y == cells[2].region.y
        for rank, cell in cells.items():
            assert cell.border_title == f"rank {rank} · tp {rank % 2} pp {rank // 2}"
            assert f"debugpy :{port_base + rank} not attached" in cell_text(app, rank)
        assert "● running" in header(app) and not app.query_one("#banner").display


async def test_live_steps_advance_while_a_request_runs(server):
    url, _ = server
    async with live_app_with_a_request(url) as (app, pilot):
        first, first_cells = header_step(app), [cell_step(app, r) for r in range(4)]
        await until(pilot, lambda: header_step(app) >= first + 3, what="engine steps")
        await until(pilot, lambda: all(cell_step(app, r) >= first_cells[r] + 3 for r in range(4)),
                    what="every worker's steps")
        assert "1 running" in header(app)
        await until(pilot, lambda: "forward" in str(app.query_one("StepTimeline").render()),
                    what="rank 0's step timeline")


async def test_live_p_pauses_and_s_steps_exactly_once(server):
    url, _ = server
    async with live_app_with_a_request(url) as (app, pilot):
        await pilot.press("p")
        assert "PAUSED" in header(app)   # at once, before the server answers
        await until(pilot, lambda: server_engine(url)["state"] == "paused", what="the server to pause")
        paused_at = server_engine(url)["step"]
        await until(pilot, lambda: header_step(app) == paused_at, what="the header to catch up")
        await pilot.pause(1.0)   # a running engine would take dozens of steps meanwhile
        assert header_step(app) == paused_at == server_engine(url)["step"]
        assert "PAUSED" in header(app)

        await pilot.press("s")
        await until(pilot, lambda: header_step(app) == paused_at + 1, what="one step")
        await until(pilot, lambda: all(cell_step(app, r) == paused_at + 1 for r in range(4)),
                    what="every worker at the new step")
        await pilot.pause(1.0)
        assert header_step(app) == paused_at + 1 == server_engine(url)["step"]
        assert "PAUSED" in header(app)

        await pilot.press("p")
        await until(pilot, lambda: header_step(app) > paused_at + 2 and "● running" in header(app),
                    what="steps after resume")


async def test_live_break_rank_1_shows_it_paused_at_the_breakpoint(server):
    url, _ = server
    async with live_app_with_a_request(url) as (app, pilot):
        await pilot.press("right", "b")
        assert app.selected_rank == 1
        try:
            await until(pilot, lambda: app.query_one("#rank-1").has_class("-paused"), 90,
                        "rank 1 at its breakpoint")
            assert "breakpoint at model_runner.py:" in cell_text(app, 1)
            assert "paused" in cell_text(app, 1).split("\n")[0]
            await until(pilot, lambda: "root cause: rank 1 (paused at model_runner.py:" in
                        str(app.query_one("#hang").render()), what="the hang view to name rank 1")
            assert not any(app.query_one(f"#rank-{r}").has_class("-paused") for r in (0, 2, 3))
            # Rank 1's own words while it waits, from its log file: it cannot answer a call.
            await until(pilot, lambda: "waiting for a debugger on 127.0.0.1:" in
                        str(app.query_one("#log-text").render()), what="rank 1's log in the detail pane")
            held_at = cell_step(app, 1)
            await pilot.pause(1.0)
            assert all(cell_step(app, r) <= held_at for r in range(4))   # nobody got past it
        finally:
            await release(app, pilot, url)
        await until(pilot, lambda: not app.query_one("#rank-1").has_class("-paused"), what="rank 1 to go on")
        await until(pilot, lambda: cell_step(app, 1) > held_at + 2, what="steps after the release")


async def release(app: DebugTUI, pilot, url: str) -> None:
    """Attach to rank 1's debugpy and continue, as VS Code would; also disarm a breakpoint that has
    not fired yet, so it cannot fire later and hold the server's shutdown."""
    await asyncio.to_thread(httpx.delete, f"{url}/debug/break", timeout=30)
    snap = await asyncio.to_thread(httpx.get, f"{url}/debug/workers", timeout=30)
    worker = snap.json()["workers"][1]
    if worker["paused"] is None:
        return
    client = await asyncio.to_thread(DAPClient, worker["debugpy"]["host"], worker["debugpy"]["port"])
    try:
        await asyncio.to_thread(client.attach)
        stopped = await asyncio.to_thread(client.wait_stopped)
        await until(pilot, lambda: "debugpy" in cell_text(app, 1) and "not attached" not in cell_text(app, 1),
                    what="rank 1 shown attached")
        await asyncio.to_thread(client.continue_, stopped["threadId"])
    finally:
        await asyncio.to_thread(client.disconnect)


def test_tui_main_keeps_logs_off_the_terminal(monkeypatch):
    """cli.main logs to stderr; inside the app an httpx line would tear the screen."""
    terminal = io.StringIO()
    handler = logging.StreamHandler(terminal)
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])

    def run(self):
        logging.getLogger("httpx").info("HTTP Request: GET /debug/workers")
        logging.getLogger("devharness.tui").warning("detail of rank 1: timed out")

    monkeypatch.setattr(DebugTUI, "run", run)
    httpx_level = logging.getLogger("httpx").level
    assert tui_app.tui_main(argparse.Namespace(url="http://127.0.0.1:1")) == 0
    assert terminal.getvalue() == ""
    assert logging.getLogger().handlers == [handler] and logging.getLogger("httpx").level == httpx_level
