"""The TUI's KV view (key `k`): the driver's KV cache as a map of blocks coloured by owner, the selected request's
table, and the block manager's last events, read from GET /debug/kv every half second (a paused engine shows the
map as it is). The marks are `devharness kv`'s (monitor/kv.py)."""
from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer, Static

from devharness.monitor import kv as kv_text
from devharness.protocol.messages import KvSnapshot

REFRESH_S = 0.5
OWNER_COLOURS = ("#9ece6a", "#7aa2f7", "#e0af68", "#bb9af7", "#73daca", "#f7768e", "#ff9e64", "#2ac3de")
CELL_STYLE = {kv_text.FREE: "#565f89", kv_text.CACHED: "#4fc1e9", kv_text.SHARED: "bold #ff007c"}
EVENT_STYLE = {"allocate": "#9ece6a", "free": "#565f89", "lookup": "#4fc1e9", "evict": "#e0af68",
               "preempt": "bold #f7768e"}


def owner_style(mark: str, selected_mark: str | None) -> str:
    if mark in CELL_STYLE:
        return CELL_STYLE[mark]
    colour = OWNER_COLOURS[kv_text.OWNER_MARKS.find(mark) % len(OWNER_COLOURS)] if mark != "#" else "white"
    return f"reverse bold {colour}" if mark == selected_mark else colour


class BlockMap(Widget):
    """Every block a character, as many a line as fit, coloured by owner; the selected request's reversed."""

    DEFAULT_CSS = "BlockMap { height: auto; }"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.snap: KvSnapshot | None = None
        self.selected: str | None = None

    def show(self, snap: KvSnapshot, selected: str | None) -> None:
        self.snap, self.selected = snap, selected
        self.refresh(layout=True)

    def _per_line(self, width: int) -> int:
        return max(8, (width - 8) // 9 * 8)   # groups of 8, a space between, after a 7-wide block number

    def get_content_height(self, container, viewport, width: int) -> int:
        if self.snap is None:
            return 1
        return -(-self.snap.num_blocks // self._per_line(width))

    def render(self) -> Text:
        if self.snap is None:
            return Text("no KV map yet", style="dim")
        cells = kv_text.block_marks(self.snap)
        mark = kv_text.owners(self.snap).get(self.selected)
        per = self._per_line(self.size.width or 80)
        out = Text(no_wrap=True)
        for start in range(0, len(cells), per):
            if start:
                out.append("\n")
            out.append(f"{start:>6} ", style="dim")
            for i, c in enumerate(cells[start:start + per]):
                if i and i % 8 == 0:
                    out.append(" ")
                out.append(c, style=owner_style(c, mark))
        return out


class KvScreen(Screen[None]):
    """The KV view; `n`/`N` select the next/previous request, Esc or `k` go back."""

    BINDINGS = [Binding("escape,k", "app.pop_screen", "Back"),
                Binding("n", "select(1)", "Next request"),
                Binding("N", "select(-1)", "Previous request")]

    def __init__(self, client, refresh_s: float = REFRESH_S) -> None:
        super().__init__()
        self.client, self.refresh_s = client, refresh_s
        self.snap: KvSnapshot | None = None
        self.selected: str | None = None
        self.error: str | None = None

    def compose(self) -> ComposeResult:
        self._summary = Static("reading GET /debug/kv ...", id="kv-summary")
        self._map = BlockMap(id="kv-map")
        self._legend = Static(id="kv-legend")
        self._requests = Static(id="kv-requests")
        self._events = Static(id="kv-events")
        yield self._summary
        yield self._map
        yield self._legend
        with Horizontal(id="kv-lower"):
            with Vertical(id="kv-left"):
                yield Static("requests (n / N select)", classes="kv-title")
                yield self._requests
            with Vertical(id="kv-right"):
                yield Static("events", classes="kv-title")
                yield self._events
        yield Footer()

    def on_mount(self) -> None:
        self.load()
        self.set_interval(self.refresh_s, self.load)

    @work(exclusive=True, group="kv")
    async def load(self) -> None:
        try:
            snap = await self.client.kv()
        except Exception as e:   # an old server, or one gone: say so and keep the last map
            self.error = str(e) or type(e).__name__
            self._summary.update(Text(f"GET /debug/kv: {self.error}", style="bold red"))
            return
        self.show(snap)

    def show(self, snap: KvSnapshot) -> None:
        self.snap, self.error = snap, None
        holders = [r.request for r in snap.requests if r.blocks]
        if self.selected not in [r.request for r in snap.requests]:
            self.selected = holders[0] if holders else (snap.requests[0].request if snap.requests else None)
        self._draw()

    def action_select(self, by: int) -> None:
        if self.snap is None or not self.snap.requests:
            return
        ids = [r.request for r in self.snap.requests]
        i = ids.index(self.selected) if self.selected in ids else -by
        self.selected = ids[(i + by) % len(ids)]
        self._draw()

    def _draw(self) -> None:
        snap = self.snap
        self._summary.update(Text(kv_text.summary(snap)))
        self._map.show(snap, self.selected)
        marks = kv_text.owners(snap)
        legend = Text()
        for mark, what in ((kv_text.FREE, "free"), (kv_text.CACHED, "cached prefix"), (kv_text.SHARED, "shared")):
            legend.append(mark, style=CELL_STYLE[mark]).append(f" {what}  ")
        for rid, mark in marks.items():
            legend.append(mark, style=owner_style(mark, marks.get(self.selected))).append(f" {rid}  ")
        self._legend.update(legend)
        rows = Text(no_wrap=True, overflow="ellipsis")
        for r in snap.requests:
            chosen = r.request == self.selected
            rows.append("> " if chosen else "  ", style="bold")
            rows.append(f"{marks.get(r.request, ' ')} ", style=owner_style(marks[r.request], None)
                        if r.request in marks else "")
            rows.append(f"{r.request:<14} {r.status:<9} {r.num_computed_tokens}/{r.num_tokens} tok, "
                        f"{r.prefix_hit_blocks} hit", style="bold" if chosen else "")
            if chosen:
                gens = ", ".join(f"{b}@g{snap.generations[b]}" for b in r.blocks)
                rows.append(f"\n    table: {gens or 'no blocks'}", style="dim")
            rows.append("\n")
        if not snap.requests:
            rows.append("no running or waiting request", style="dim")
        self._requests.update(rows)
        self.request_rows = rows
        log = Text(no_wrap=True, overflow="ellipsis")
        for e in reversed(snap.events[-40:]):
            log.append(f"{e.step:>6} ", style="dim").append(f"{e.kind:<8} ", style=EVENT_STYLE.get(e.kind, ""))
            log.append(f"{e.request or '':<10} {e.blocks if e.blocks else ''} {e.detail}".rstrip() + "\n",
                       style="bold" if e.request == self.selected else "")
        self._events.update(log)
        self.event_log = log
