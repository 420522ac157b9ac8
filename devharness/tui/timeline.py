"""The TUI's timeline view (key `l`): every rank down, time across the last steps, each cell busy (preparing,
computing, in a TP collective, sampling), waiting on the pipeline (a send or receive) or idle (between steps: the
bubble); each row ends with its stage's bubble fraction, and the straggler's row says where it comes late. Read
from each rank's GET /debug/workers/{rank}/history and GET /debug/timeline (diagnostics/timeline.py's answers)
every second.

A step's phases are laid end to end from its start, in the order the worker first ran each (the history keeps
each phase's total per step, not each stretch), so the cells within a step show its shares, not the exact order."""
from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from devharness.diagnostics.timeline import BUSY_PHASES, P2P
from devharness.protocol.messages import StepRecord

REFRESH_S = 1.0
STEPS = 16
IDLE, PIPE, BUSY = 0, 1, 2
CELL = {BUSY: ("█", "#9ece6a"), PIPE: ("▒", "#e0af68"), IDLE: ("·", "dim")}


def window(histories: dict[int, list[StepRecord]], steps: int = STEPS) -> tuple[list[int], float, float] | None:
    """The last `steps` step numbers every rank's history holds, and their span (unix seconds): the first start to
    the last end over all ranks. None without a finished step."""
    held = sorted({r.step for recs in histories.values() for r in recs
                   if r.step >= 1 and r.started_at is not None and r.total_ms is not None})[-steps:]
    if not held:
        return None
    chosen = set(held)
    spans = [(r.started_at, r.started_at + r.total_ms / 1000) for recs in histories.values() for r in recs
             if r.step in chosen and r.started_at is not None and r.total_ms is not None]
    return held, min(a for a, _ in spans), max(b for _, b in spans)


def cells(records: list[StepRecord], in_window: set[int], start: float, end: float, width: int) -> list[int]:
    """One rank's row: `width` cells over [start, end], each BUSY when busy phases fill half of it or more, PIPE
    when busy and pipeline waits together do, else IDLE."""
    span = (end - start) / width
    busy, pipe = [0.0] * width, [0.0] * width
    for rec in records:
        if rec.step not in in_window or rec.started_at is None:
            continue
        t = rec.started_at
        for phase, ms in rec.phases.items():
            kind = busy if phase in BUSY_PHASES else pipe if phase in P2P else None
            a, b = t, t + ms / 1000
            t = b
            if kind is None or b <= start or a >= end:
                continue
            for i in range(max(0, int((a - start) / span)), min(width, int((b - start) / span) + 1)):
                lo, hi = start + i * span, start + (i + 1) * span
                kind[i] += max(0.0, min(b, hi) - max(a, lo))
    return [BUSY if busy[i] >= span / 2 else PIPE if busy[i] + pipe[i] >= span / 2 else IDLE for i in range(width)]


def draw(histories: dict[int, list[StepRecord]], layout: dict[int, tuple[int, int]], answers: dict | None,
         width: int = 80, steps: int = STEPS) -> tuple[Text, dict[int, list[int]]]:
    """The view's text and each rank's cells. `layout`: rank -> (tp rank, pp rank)."""
    out = Text(no_wrap=True, overflow="ellipsis")
    got = window(histories, steps)
    if got is None:
        out.append("no finished step yet", style="dim")
        return out, {}
    held, start, end = got
    in_window = set(held)
    out.append(f"steps {held[0]}..{held[-1]}: {(end - start) * 1000:.1f} ms across;  ", style="bold")
    for kind, label in ((BUSY, "busy"), (PIPE, "waiting on the pipeline"), (IDLE, "idle (bubble)")):
        out.append(CELL[kind][0], style=CELL[kind][1]).append(f" {label}  ")
    out.append("\n")
    stages = {s["pp_rank"]: s for s in (answers or {}).get("stages", [])}
    straggler = (answers or {}).get("straggler")
    rows = {}
    for rank in sorted(histories):
        tp, pp = layout.get(rank, (0, 0))
        row = rows[rank] = cells(histories[rank], in_window, start, end, width)
        out.append(f"rank {rank:<2} tp{tp} pp{pp} ")
        for c in row:
            out.append(CELL[c][0], style=CELL[c][1])
        stage = stages.get(pp)
        if stage is not None:
            out.append(f" bubble {stage['bubble_fraction']:.0%}")
        if straggler is not None and straggler.get("rank") == rank:
            where = f"layer {straggler['layer']} {straggler['site']}" if straggler.get("layer") is not None \
                else straggler.get("site", "")
            out.append(f"  ◀ straggler: late at {where} by {straggler['late_ms_p50']:.1f} ms", style="bold #f7768e")
        out.append("\n")
    if straggler is None and answers is not None:
        out.append("straggler: none (no rank is consistently late)\n", style="dim")
    return out, rows


class TimelineScreen(Screen[None]):
    """The timeline view; Esc or `l` go back."""

    BINDINGS = [Binding("escape,l", "app.pop_screen", "Back")]

    def __init__(self, client, refresh_s: float = REFRESH_S, steps: int = STEPS) -> None:
        super().__init__()
        self.client, self.refresh_s, self.steps = client, refresh_s, steps
        self.text: Text | None = None
        self.rows: dict[int, list[int]] = {}

    def compose(self) -> ComposeResult:
        yield Static("timeline: every rank over the last steps (l or Esc: back)", classes="kv-title")
        with VerticalScroll():
            self._body = Static("reading the ranks' histories ...", id="tl-body")
            yield self._body
        yield Footer()

    def on_mount(self) -> None:
        self.load()
        self.set_interval(self.refresh_s, self.load)

    @work(exclusive=True, group="timeline")
    async def load(self) -> None:
        try:
            snap = await self.client.snapshot()
            layout = {w.rank: (w.tp_rank, w.pp_rank) for w in snap.workers}
            histories = {}
            for rank in layout:
                recs = await self.client.history(rank)
                histories[rank] = recs or []
            answers = await self.client.timeline(self.steps)
        except Exception as e:   # an old server, or one gone: say so and keep the last view
            self._body.update(Text(f"timeline: {str(e) or type(e).__name__}", style="bold red"))
            return
        width = max(20, (self.size.width or 100) - 60)
        self.text, self.rows = draw(histories, layout, answers, width, self.steps)
        self._body.update(self.text)
