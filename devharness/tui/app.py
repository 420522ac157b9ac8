"""`devharness tui`: the App, its keys, and the wiring from the debug client to the panels.

All server I/O runs in Textual workers (network calls in handlers would freeze the UI); the
feed posts snapshots as messages, the handlers hand them to the panels, and a local tick keeps
"time in phase" counting while a hung server has nothing new to send.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Awaitable, Callable
from urllib.parse import urlparse

import httpx
import msgspec
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container, Vertical
from textual.logging import TextualHandler
from textual.widgets import Footer, TabbedContent
from textual.worker import Worker

from devharness.protocol.messages import Snapshot, WorkerState
from devharness.diagnostics.hang import LEDGER_WINDOW, find_waits, root_blockers, straggler_note
from devharness.tui.client import (ConnectionChanged, DebugApiError, DebugClient, HttpDebugClient,
                                   SnapshotReceived, follow)
from devharness.tui.detail import DetailPane, attach_config
from devharness.tui.dialogs import BreakDialog, HelpScreen
from devharness.tui.widgets import (SLOW_S, ConnectionBanner, EngineHeader, HangPanel, PromptTrace,
                                    TopologyGrid, WorkerCell, reached_line)

TEST_PROMPT = "The capital of France is"
SERVER_ERRORS = (httpx.HTTPError, DebugApiError)


class DebugTUI(App[None]):
    """A live view of one debug server, driven entirely through the injected `client`."""

    CSS_PATH = "app.tcss"
    TITLE = "devharness"
    ENABLE_COMMAND_PALETTE = False
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (140, "-wide")]
    BINDINGS = [
        Binding("p", "toggle_pause", "Pause/Resume"),
        Binding("s", "step", "Step"),
        Binding("b", "break_next", "Break"),
        Binding("B", "break_at", "Break at"),
        Binding("t", "stacks", "Stacks"),
        Binding("f", "fold", "Fold threads", show=False),
        Binding("d", "bundle", "Bundle"),
        Binding("k", "kv", "KV cache"),
        Binding("w", "requests", "Requests", show=False),   # in the help; the footer is full
        Binding("l", "timeline", "Timeline", show=False),
        Binding("g", "test_prompt", "Prompt"),
        Binding("c", "copy_attach", "Copy attach", show=False),
        Binding("r", "release", "Release", show=False),
        Binding("R", "release_all", "Release all", show=False),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, client: DebugClient, *, clock: Callable[[], float] = time.time,
                 tick_s: float = 0.5, retry_s: float = 0.5, prompt: str = TEST_PROMPT) -> None:
        super().__init__()
        self.client = client
        self._clock = clock
        self._tick_s = tick_s
        self._retry_s = retry_s
        self._prompt = prompt
        self._skew_s = 0.0            # server clock minus ours, when the server says its time
        self.snapshot: Snapshot | None = None
        self.selected_rank: int | None = None
        self._detail_key: tuple[int, int] | None = None
        self._reached_at = -1e9
        self._detail_load: Worker | None = None
        # Control calls go out one at a time, in key order: p p must not reach the server as
        # resume, pause on two pooled connections.
        self._control_lock = asyncio.Lock()
        self._bundle_seen: str | None = ""   # the last bundle path the user was told of
        self._pending_state: str | None = None   # "paused"/"running" asked of the server, not yet seen in a snapshot

    def now(self) -> float:
        """The server's idea of now: phase_since stamps come from worker clocks."""
        return self._clock() + self._skew_s

    def compose(self) -> ComposeResult:
        # Panels are kept by reference, not queried: a timer or worker that fires while the
        # app shuts down then updates a detached widget instead of failing on a query.
        self._header = EngineHeader(self.client.base_url, id="engine")
        self._banner = ConnectionBanner(id="banner")
        self._grid = TopologyGrid(id="grid", on_select=self._select_if_new)
        self._hang = HangPanel(id="hang")
        self._trace = PromptTrace(id="trace")
        self._detail = DetailPane(id="detail")
        yield self._header
        yield self._banner
        with Container(id="body"):
            with Vertical(id="left"):
                yield self._grid
                yield self._hang
                yield self._trace
            yield self._detail
        yield Footer()

    def on_mount(self) -> None:
        self.feed()
        self.set_interval(self._tick_s, self._tick)

    @work(exclusive=True, group="feed")
    async def feed(self) -> None:
        await follow(self.client, self.post_message, retry_s=self._retry_s)

    async def on_unmount(self) -> None:
        await self.client.aclose()

    # -- snapshots --------------------------------------------------------------------------

    @on(SnapshotReceived)
    def _on_snapshot(self, message: SnapshotReceived) -> None:
        snap = self.snapshot = self._with_pending_state(message.snapshot)
        if snap.server_time is not None:
            self._skew_s = snap.server_time - self._clock()
        now = self.now()
        rebuilt = self._grid.show(snap, now)
        self._header.record(snap.engine, now)
        waits = find_waits(snap, now, SLOW_S)
        self._hang.show(waits, snap.engine.hang, snap.engine.stalls)
        self._refresh_reached(waits)
        self._trace.observe(snap, now)
        if snap.engine.bundle != self._bundle_seen:   # a bundle the server wrote on its own (a hang, an error)
            if self._bundle_seen != "" and snap.engine.bundle:   # "": no snapshot yet; an old bundle is not news
                self.notify(f"bundle written: {snap.engine.bundle}", severity="warning", timeout=15)
            self._bundle_seen = snap.engine.bundle
        ranks = [w.rank for w in snap.workers]
        if ranks and self.selected_rank not in ranks:
            self._select(min(ranks))
        elif (w := self._selected_worker()) is not None:
            self._detail.show_worker(w)
        if rebuilt:   # the focused cell, if any, was just replaced
            self.call_after_refresh(self._focus_selected)

    @on(ConnectionChanged)
    def _on_connection(self, message: ConnectionChanged) -> None:
        self._banner.show(message.connected, self.client.base_url, message.reason, message.retry_in_s,
                          has_state=self.snapshot is not None)
        self.default_screen.set_class(not message.connected, "-disconnected")

    def _tick(self) -> None:
        if self.snapshot is None:
            return
        now = self.now()
        self._grid.tick(now)
        self._header.record(self.snapshot.engine, now)
        waits = find_waits(self.snapshot, now, SLOW_S)
        self._hang.show(waits, self.snapshot.engine.hang, self.snapshot.engine.stalls)
        self._refresh_reached(waits)
        self._refresh_detail()

    def _refresh_reached(self, waits) -> None:
        """While the hang view shows, at most once a second: how far each rank got in each group."""
        if not waits:
            self._hang.reached, self._hang.straggler = None, ""
            return
        t = time.monotonic()
        if t - self._reached_at >= 1.0:
            self._reached_at = t
            self.load_reached([w.rank for w in self.snapshot.workers])

    # -- selection and the detail pane ------------------------------------------------------

    @on(WorkerCell.Selected)
    def _on_selected(self, message: WorkerCell.Selected) -> None:
        # A cell says it was focused; by the time the message lands focus may have moved on (arrows
        # typed in one go pass through cells), and a stale one would select a rank the user left.
        # (Widget.has_focus is set by the Focus event itself, so it lags; the screen's is current.)
        cell = self._grid.cell(message.rank)
        if cell is not None and cell.is_attached and cell.screen.focused is cell:
            self._select_if_new(message.rank)

    def _select_if_new(self, rank: int) -> None:
        if rank != self.selected_rank:
            self._select(rank)

    def _select(self, rank: int) -> None:
        self.selected_rank = rank
        self._grid.select(rank)
        if (w := self._selected_worker()) is not None:
            self._detail.show_worker(w)
        self._detail.show_stack(f"press t to take rank {rank}'s Python stacks")
        self._refresh_detail(force=True)
        if self._detail.tabs.active == "tab-stack":
            self.load_stack(rank)

    def _focus_selected(self) -> None:
        cell = self._grid.cell(self.selected_rank)
        if cell is not None and not isinstance(self.focused, WorkerCell):
            cell.focus()

    def _selected_worker(self) -> WorkerState | None:
        workers = self.snapshot.workers if self.snapshot else []
        return next((w for w in workers if w.rank == self.selected_rank), None)

    def _refresh_detail(self, force: bool = False) -> None:
        # From the tick, only when the engine stepped or the selected worker paused or went on (what it
        # logged on the way is worth seeing while it waits), never on top of a fetch still running:
        # an exclusive worker restarted on every tick would never finish on a slow server. Busy is
        # read from the latest load itself: a flag cleared in the worker's `finally` would be
        # cleared late by the load a forced one cancelled, and from then on nothing would hold.
        if self.selected_rank is None or self.snapshot is None:
            return
        busy = self._detail_load is not None and not self._detail_load.is_finished
        worker = self._selected_worker()
        key = (self.selected_rank, self.snapshot.engine.step, worker is not None and worker.paused is not None)
        if force or (key != self._detail_key and not busy):
            self._detail_key = key
            self._detail_load = self.load_detail(self.selected_rank)

    @work(exclusive=True, group="detail")
    async def load_detail(self, rank: int) -> None:
        try:
            history, logs, ledger = await asyncio.gather(self.client.history(rank), self.client.logs(rank),
                                                         self.client.collectives(rank))
        except SERVER_ERRORS as e:
            self.log.warning(f"detail of rank {rank}: {e}")   # the feed's banner reports outages
            return
        if rank == self.selected_rank:
            self._detail.show_history(history)
            self._detail.show_logs(logs)
            self._detail.show_collectives(ledger)

    @work(exclusive=True, group="reached")
    async def load_reached(self, ranks: list[int]) -> None:
        """While the hang view shows: how far each rank got in each group, from their ledgers."""
        try:
            got = await asyncio.gather(*(self.client.collectives(r, LEDGER_WINDOW) for r in ranks))
        except SERVER_ERRORS as e:
            self.log.warning(f"collective ledgers: {e}")
            return
        ledgers = {r: led for r, led in zip(ranks, got) if led is not None}
        self._hang.reached = reached_line(ledgers) if ledgers else None
        if self.snapshot is not None:
            waits = find_waits(self.snapshot, self.now(), SLOW_S)
            # The same words as the engine's detector: a rank late every step, but not the one the wait is for.
            hung = [b.rank for b in root_blockers(waits)] or [b.rank for w in waits for b in w.blockers]
            self._hang.straggler = straggler_note(ledgers, hung) if ledgers else ""
            engine = self.snapshot.engine
            self._hang.show(waits, engine.hang, engine.stalls)

    @work(exclusive=True, group="stack")
    async def load_stack(self, rank: int) -> None:
        self._detail.show_stack(f"taking rank {rank}'s stacks…")
        try:
            stacks = await self.client.stack(rank)
        except SERVER_ERRORS as e:
            self._detail.show_stack(f"could not take rank {rank}'s stacks: {e}")
            return
        step = self.snapshot.engine.step if self.snapshot else "?"
        self._detail.show_dump(f"rank {rank}, engine step {step} (t takes them again)", stacks)

    @on(TabbedContent.TabActivated, "#detail-tabs")
    def _on_tab(self, event: TabbedContent.TabActivated) -> None:
        if event.pane.id == "tab-stack" and self.selected_rank is not None:
            self.load_stack(self.selected_rank)

    # -- actions ------------------------------------------------------------------------------

    @work(group="control")
    async def control(self, what: str, call: Callable[[], Awaitable[None]], done: str = "") -> None:
        try:
            async with self._control_lock:
                await call()
        except SERVER_ERRORS as e:
            self.notify(f"{what} failed: {e}", severity="error")
        else:
            if done:
                self.notify(done)

    def action_toggle_pause(self) -> None:
        if self.snapshot is None:
            return
        paused = self.snapshot.engine.state == "paused"
        # Flip at once so a second p resumes even before the server's next snapshot lands.
        self._pending_state = "running" if paused else "paused"
        engine = msgspec.structs.replace(self.snapshot.engine, state=self._pending_state)
        self.snapshot = msgspec.structs.replace(self.snapshot, engine=engine)
        self._header.engine = engine
        self.control("resume" if paused else "pause", self._pause_or_resume(paused))

    def _pause_or_resume(self, paused: bool):
        async def call() -> None:
            try:
                await (self.client.resume() if paused else self.client.pause())
            finally:   # done (or refused): from now on the server's snapshots say how it is
                self._pending_state = None
        return call

    def _with_pending_state(self, snap: Snapshot) -> Snapshot:
        """A snapshot sent before the server took our pause (or resume) still says the old state: until the
        server has answered, or a snapshot says the new state, show the state asked for (a second p must
        undo the first)."""
        if self._pending_state is None:
            return snap
        if snap.engine.state == self._pending_state or snap.engine.state in ("stopped", "dead"):
            self._pending_state = None
            return snap
        return msgspec.structs.replace(snap, engine=msgspec.structs.replace(snap.engine, state=self._pending_state))

    def action_step(self) -> None:
        self.control("step", lambda: self.client.step(1))

    def action_break_next(self) -> None:
        if (rank := self.selected_rank) is not None:
            self.control(f"break rank {rank}", lambda: self.client.arm_break(rank=rank),
                         f"rank {rank} will break at its next step")

    def action_break_at(self) -> None:
        if (rank := self.selected_rank) is None:
            return

        def armed(where: tuple[int | None, int | None] | None) -> None:
            if where is not None:
                step, layer = where
                self.control(f"break rank {rank}",
                             lambda: self.client.arm_break(rank=rank, step=step, layer=layer),
                             f"rank {rank} will break at step {'next' if step is None else step}, "
                             f"layer {'start' if layer is None else layer}")

        self.push_screen(BreakDialog(rank), armed)

    def action_release(self) -> None:
        if (rank := self.selected_rank) is not None:
            self.control(f"release rank {rank}", lambda: self._release(rank))

    def action_release_all(self) -> None:
        self.control("release", lambda: self._release(None))

    async def _release(self, rank: int | None) -> None:
        released = await self.client.release(rank)
        who = "all ranks" if rank is None else f"rank {rank}"
        self.notify(f"released {', '.join(f'rank {r}' for r in released)}" if released else
                    f"{who}: nothing to release (not paused, or a debugger is attached)")

    def action_stacks(self) -> None:
        tabs = self._detail.tabs
        if tabs.active != "tab-stack":
            tabs.active = "tab-stack"   # activating the tab takes the stacks
        elif self.selected_rank is not None:
            self.load_stack(self.selected_rank)

    def action_fold(self) -> None:
        self._detail.toggle_fold()

    def action_bundle(self) -> None:
        self.control("bundle", self._bundle)

    async def _bundle(self) -> None:
        self._bundle_seen = path = await self.client.bundle()
        self.notify(f"bundle written: {path}", timeout=15)

    def action_test_prompt(self) -> None:
        self.send_prompt()

    @work(exclusive=True, group="prompt")
    async def send_prompt(self) -> None:
        stages = sorted({w.pp_rank for w in self.snapshot.workers}) if self.snapshot else []
        self._trace.start(self._prompt, stages, self.now())
        try:
            result = await self.client.complete(self._prompt, max_tokens=16)
        except SERVER_ERRORS as e:
            result = str(e) or type(e).__name__
        self._trace.finish(result, self.now())

    def action_copy_attach(self) -> None:
        if (w := self._selected_worker()) is not None:
            self.copy_to_clipboard(attach_config(w))
            self.notify(f"copied rank {w.rank}'s attach configuration")

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_kv(self) -> None:
        from devharness.tui.kv import KvScreen
        self.push_screen(KvScreen(self.client))

    def action_requests(self) -> None:
        from devharness.tui.requests import RequestsScreen
        self.push_screen(RequestsScreen(self.client, clock=self.now))

    def action_timeline(self) -> None:
        from devharness.tui.timeline import TimelineScreen
        self.push_screen(TimelineScreen(self.client))


def tui_main(args) -> int:
    """Entry of `devharness tui --url URL`."""
    url = urlparse(args.url)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ValueError(f"--url expects http://HOST:PORT of a `devharness serve --debug` server, not {args.url!r}")
    with logs_off_the_terminal():
        DebugTUI(HttpDebugClient(args.url, token=getattr(args, "token", None),
                                 api_key=getattr(args, "api_key", None))).run()
    return 0


@contextlib.contextmanager
def logs_off_the_terminal():
    """While the app runs, log records go to Textual's log (`textual console` shows them).

    cli.main's handler writes to stderr, the terminal the app draws on: httpx logs every request
    at INFO, four a second from the stream alone, and each line would tear the screen."""
    root, quiet = logging.getLogger(), [logging.getLogger(n) for n in ("httpx", "httpcore")]
    saved_handlers, saved_levels = root.handlers[:], [q.level for q in quiet]
    root.handlers = [TextualHandler()]
    for q in quiet:
        q.setLevel(max(q.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        root.handlers = saved_handlers
        for q, level in zip(quiet, saved_levels):
            q.setLevel(level)
