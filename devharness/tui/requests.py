"""The TUI's requests view (key `w`): every running and waiting request, oldest first, with why it waits (a code of
engine/request_story.py and its numbers), then the last finished ones; the stalls the detector reported; and the
selected request's story. Read from GET /debug/requests and GET /debug/requests/{id} every half second; the text is
`devharness requests`' (monitor/requests_view.py)."""
from __future__ import annotations

import time

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from devharness.monitor.requests_view import render_story
from devharness.protocol.messages import RequestsSnapshot, RequestStory

REFRESH_S = 0.5
STATE_STYLE = {"waiting": "#e0af68", "preempted": "bold #f7768e", "running": "#9ece6a", "finished": "dim",
               "aborted": "dim"}
LIVE = ("waiting", "preempted", "running")


def ordered(snap: RequestsSnapshot) -> list:
    """The live requests by age, oldest first, then the finished ones (most recent last, as the server keeps them)."""
    live = sorted((r for r in snap.requests if r.state in LIVE), key=lambda r: r.arrival_time)
    return live + [r for r in snap.requests if r.state not in LIVE]


class RequestsScreen(Screen[None]):
    """The requests view; `n`/`N` select the next/previous request, Esc or `w` go back."""

    BINDINGS = [Binding("escape,w", "app.pop_screen", "Back"),
                Binding("n", "select(1)", "Next request"),
                Binding("N", "select(-1)", "Previous request")]

    def __init__(self, client, refresh_s: float = REFRESH_S, clock=time.time) -> None:
        super().__init__()
        self.client, self.refresh_s, self.clock = client, refresh_s, clock
        self.snap: RequestsSnapshot | None = None
        self.story: RequestStory | None = None
        self.selected: str | None = None

    def compose(self) -> ComposeResult:
        self._summary = Static("reading GET /debug/requests ...", id="rq-summary")
        self._rows = Static(id="rq-rows")
        self._stalls = Static(id="rq-stalls")
        self._story = Static(id="rq-story")
        yield self._summary
        yield self._stalls
        with VerticalScroll(id="rq-upper"):
            yield self._rows
        yield Static("story (n / N select)", classes="kv-title")
        yield self._story
        yield Footer()

    def on_mount(self) -> None:
        self.load()
        self.set_interval(self.refresh_s, self.load)

    @work(exclusive=True, group="requests")
    async def load(self) -> None:
        try:
            snap = await self.client.requests()
            rows = ordered(snap)
            if self.selected not in [r.request_id for r in rows]:
                self.selected = rows[0].request_id if rows else None
            story = await self.client.request_story(self.selected) if self.selected else None
        except Exception as e:   # an old server, or one gone: say so and keep the last view
            self._summary.update(Text(f"GET /debug/requests: {str(e) or type(e).__name__}", style="bold red"))
            return
        self.show(snap, story)

    def show(self, snap: RequestsSnapshot, story: RequestStory | None) -> None:
        self.snap, self.story = snap, story
        self._draw()

    def action_select(self, by: int) -> None:
        if self.snap is None or not self.snap.requests:
            return
        ids = [r.request_id for r in ordered(self.snap)]
        i = ids.index(self.selected) if self.selected in ids else -by
        self.selected = ids[(i + by) % len(ids)]
        self.story = None
        self._draw()
        self.load()

    def _draw(self) -> None:
        snap, now = self.snap, self.snap.time or self.clock()
        waiting = sum(r.state in ("waiting", "preempted") for r in snap.requests)
        self._summary.update(Text(f"requests at step {snap.step}{' (engine paused)' if snap.paused else ''}: "
                                  f"{waiting} waiting, {sum(r.state == 'running' for r in snap.requests)} running"))
        rows = Text(no_wrap=True, overflow="ellipsis")
        rows.append(f"  {'request':<18} {'state':<9} {'age s':>7} {'queued s':>8} {'pre':>3}  why it waits\n",
                    style="bold")
        for r in ordered(snap):
            chosen = r.request_id == self.selected
            why = f"{r.waiting_reason.code}: {r.waiting_reason.detail}" if r.waiting_reason else (r.finish_reason or "")
            if r.state in ("waiting", "preempted") and r.waiting_reason is None:
                why = "none: no reason held it at the last pass"
            rows.append("> " if chosen else "  ", style="bold")
            rows.append(f"{r.request_id:<18} ", style="bold" if chosen else "")
            rows.append(f"{r.state:<9} ", style=STATE_STYLE.get(r.state, ""))
            rows.append(f"{now - r.arrival_time:>7.1f} {r.queued_s:>8.2f} {r.num_preemptions:>3}  {why}\n",
                        style="bold" if chosen else "")
        if not snap.requests:
            rows.append("  no request yet", style="dim")
        self._rows.update(rows)
        self.request_rows = rows
        stalls = Text(no_wrap=True, overflow="ellipsis")
        for s in snap.stalls:
            stalls.append("stall: ", style="bold #f7768e").append(
                f"step {s.step} request {s.request_id} {s.kind}: {s.detail}\n")
        self._stalls.update(stalls)
        self._stalls.display = bool(snap.stalls)
        story = self.story if self.story is not None and self.story.request_id == self.selected else None
        self.story_text = render_story(story) if story else (f"reading {self.selected}'s story ..." if self.selected
                                                             else "")
        self._story.update(Text(self.story_text, no_wrap=True, overflow="ellipsis"))
