"""The TUI's panels, a class each (the detail pane is in detail.py). Panels take data through
reactives or a `show` method and redraw in place, so a snapshot every 250 ms repaints only what
changed, without flicker."""
from __future__ import annotations

from collections import deque
from typing import Callable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Container, Horizontal
from textual.content import Content
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Sparkline, Static

from devharness.protocol.messages import EngineStats, Snapshot, WorkerState
from devharness.diagnostics.hang import Wait, root_blockers
from devharness.tui.client import Completion

SLOW_S = 2.0     # time in one phase that turns a cell yellow; also when the hang view speaks up
STUCK_S = 10.0   # ... and red
PHASE_STYLE = {"idle": "$text-muted", "recv": "#4fc1e9", "send": "#4fc1e9", "prepare": "#7aa2f7",
               "forward": "#9ece6a", "collective": "#bb9af7", "sample": "#73daca",
               "paused": "$warning bold", "stopped": "$error bold", "dead": "$error bold"}


def fmt_s(seconds: float) -> str:
    if seconds < 10:
        return f"{max(seconds, 0):.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


def effective_phase(w: WorkerState) -> str:
    return "dead" if not w.alive else "paused" if w.paused is not None else w.phase


def time_in_phase(w: WorkerState, now: float) -> float | None:
    since = w.paused.since if w.paused is not None and w.paused.since else w.phase_since
    return None if since is None or effective_phase(w) == "dead" else now - since


def alarm(w: WorkerState, now: float) -> str:
    """"slow" or "stuck" for a worker long in a working phase; idle or paused is no alarm."""
    elapsed = time_in_phase(w, now)
    if elapsed is None or effective_phase(w) in ("idle", "paused"):
        return ""
    return "stuck" if elapsed >= STUCK_S else "slow" if elapsed >= SLOW_S else ""


class WorkerCell(Widget, can_focus=True):
    """One rank: identity, step, phase and time in it, load, KV use, debugger."""

    state: reactive[WorkerState] = reactive(WorkerState(rank=0), layout=False)
    now: reactive[float] = reactive(0.0)

    class Selected(Message):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank

    def __init__(self, state: WorkerState, now: float) -> None:
        super().__init__(id=f"rank-{state.rank}")
        self.set_reactive(WorkerCell.state, state)
        self.set_reactive(WorkerCell.now, now)

    def on_focus(self) -> None:
        self.post_message(self.Selected(self.state.rank))

    def on_mount(self) -> None:
        self.watch_state()

    def watch_state(self) -> None:
        w, phase, alarm_ = self.state, effective_phase(self.state), alarm(self.state, self.now)
        for name, on in (("dead", phase == "dead"), ("paused", phase == "paused"),
                         ("slow", alarm_ == "slow"), ("stuck", alarm_ == "stuck")):
            self.set_class(on, f"-{name}")
        self.border_title = f"rank {w.rank} · tp {w.tp_rank} pp {w.pp_rank}"
        self.border_subtitle = f"{w.node_ip} pid {w.pid if w.pid is not None else '?'}"

    watch_now = watch_state

    def render(self) -> Content:
        w, phase, elapsed = self.state, effective_phase(self.state), time_in_phase(self.state, self.now)
        time_style = {"stuck": "$error bold", "slow": "$warning"}.get(alarm(w, self.now), "")
        head = Content.assemble(("step ", "dim"), "?" if w.step is None else str(w.step), "  ",
                                (phase, PHASE_STYLE.get(phase, "")), "  ",
                                ("" if elapsed is None else fmt_s(elapsed), time_style))
        if w.paused is not None:
            where = Content.styled(f"‖ {w.paused.reason.replace('_', ' ')} at {w.paused.location}", "$warning")
        elif phase == "dead":
            where = Content.styled(w.detail or "not alive", "$error")
        else:
            where = Content(w.detail or "")
        ms = "–" if w.last_step_ms is None else f"{w.last_step_ms:.1f} ms"
        load = Content.assemble(("last ", "dim"), ms, ("  reqs ", "dim"), str(w.num_reqs),
                                ("  tok ", "dim"), str(w.num_tokens))
        return Content("\n").join([head, where, load, self._kv_bar(), self._debugger()])

    def _kv_bar(self) -> Content:
        used, total = self.state.kv_blocks_used, self.state.kv_blocks_total
        counts = f" {used}/{total}"
        width = max(4, self.content_size.width - 3 - len(counts))
        filled = round(width * used / total) if total else 0
        style = "$error" if total and used / total > 0.9 else "$success"
        return Content.assemble(("KV ", "dim"), ("█" * filled, style), ("░" * (width - filled), "dim"), counts)

    def _debugger(self) -> Content:
        d = self.state.debugpy
        if d is None or d.port is None:
            return Content.styled("debugpy off", "dim")
        attached = ("attached", "$success bold") if d.client_connected else ("not attached", "dim")
        return Content.assemble(("debugpy ", "dim"), f":{d.port} ", attached)


class TopologyGrid(Container):
    """Workers laid out as the topology: PP stages are rows, TP ranks columns."""

    BINDINGS = [Binding("up", "move(-1, 0)", show=False), Binding("down", "move(1, 0)", show=False),
                Binding("left", "move(0, -1)", show=False), Binding("right", "move(0, 1)", show=False)]

    def __init__(self, on_select: Callable[[int], None] | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self._cells: dict[int, WorkerCell] = {}
        self._pos: dict[tuple[int, int], int] = {}   # (pp_rank, tp_rank) -> rank
        self._selected: int | None = None
        self._on_select = on_select   # called at once when the arrows select a rank

    def show(self, snapshot: Snapshot, now: float) -> bool:
        """Show `snapshot`; True when the topology changed and the cells were rebuilt."""
        workers = sorted(snapshot.workers, key=lambda w: (w.pp_rank, w.tp_rank))
        pos = {(w.pp_rank, w.tp_rank): w.rank for w in workers}
        if pos != self._pos:   # new topology: rebuild; otherwise update cells in place
            self.remove_children()
            self._pos = pos
            self._cells = {w.rank: WorkerCell(w, now) for w in workers}
            self.styles.grid_size_columns = max((w.tp_rank for w in workers), default=0) + 1
            self.mount_all(self._cells.values())
            self.select(self._selected)
            return True
        for w in workers:
            cell = self._cells[w.rank]
            cell.state = w
            cell.now = now
        return False

    def tick(self, now: float) -> None:
        for cell in self._cells.values():
            cell.now = now

    def select(self, rank: int | None) -> None:
        """Mark `rank` as the one the detail pane shows, even while focus is elsewhere."""
        self._selected = rank
        for r, cell in self._cells.items():
            cell.set_class(r == rank, "-selected")

    def cell(self, rank: int | None) -> WorkerCell | None:
        return self._cells.get(rank)

    def action_move(self, d_pp: int, d_tp: int) -> None:
        # Move from the selected cell and select at once: focus (and the Selected message it
        # sends) lands only after queued keys are handled, so "right b" typed in one go would
        # otherwise arm a breakpoint on the rank the user just left.
        here = self._cells.get(self._selected)
        if here is None:
            return
        target = self._pos.get((here.state.pp_rank + d_pp, here.state.tp_rank + d_tp))
        if target is not None:
            self.select(target)
            if self._on_select is not None:
                self._on_select(target)
            # Focus now, not after the queued keys (Widget.focus defers): a cell's Selected message
            # then finds focus already gone on, and the app drops it instead of going back a rank.
            self.screen.set_focus(self._cells[target])


class EngineHeader(Horizontal):
    """Engine step, running and waiting requests, tokens/s with its sparkline, running/paused."""

    engine: reactive[EngineStats | None] = reactive(None, init=False)

    SAMPLE_S = 0.5   # the sparkline's time axis: one sample per half second, however often snapshots come

    def __init__(self, url: str, history_len: int = 60, **kwargs) -> None:
        super().__init__(**kwargs)
        self._url = url
        self._throughput: deque[float] = deque(maxlen=history_len)
        self._sampled_at: float | None = None

    def compose(self) -> ComposeResult:
        # Kept by reference, not queried: the app's tick may land while the header is torn down.
        self._text, self._spark = Static("connecting…", id="engine-text"), Sparkline([], id="throughput")
        self._extra = Static("", id="engine-extra")
        yield from (self._text, self._spark, self._extra)
        yield Static(self._url, id="engine-url", markup=False)

    def record(self, engine: EngineStats, now: float) -> None:
        due = self._sampled_at is None or now - self._sampled_at >= self.SAMPLE_S
        if engine.tokens_per_s is not None and due:
            self._sampled_at = now
            self._throughput.append(engine.tokens_per_s)
            # One point would fill the whole sparkline, which reads as "maximum".
            self._spark.data = list(self._throughput) if len(self._throughput) > 1 else []
        self.engine = engine

    def watch_engine(self, e: EngineStats) -> None:
        state = {"running": ("● running", "$success bold"), "paused": (" PAUSED ", "$warning bold reverse")
                 }.get(e.state, (f"■ {e.state}", "$error bold"))   # "stopped", "dead"
        rate = "–" if e.tokens_per_s is None else f"{e.tokens_per_s:.0f}"
        self._text.update(Content.assemble(
            state, ("  step ", "dim"), str(e.step), "  ", str(e.num_running), (" running  ", "dim"),
            str(e.num_waiting), (" waiting  ", "dim"), (rate, "bold"), (" tok/s", "dim")))
        extra = []
        if e.last_step_ms:   # 0.0 until the first step
            extra += [("last step ", "dim"), f"{e.last_step_ms:.1f} ms  "]
        if e.kv_blocks_total:
            extra += [("KV ", "dim"), f"{e.kv_blocks_used}/{e.kv_blocks_total}"]
        self._extra.update(Content.assemble(*extra))


class ConnectionBanner(Static):
    """Says when the server is unreachable; the last snapshot stays on screen below it."""

    def show(self, connected: bool, url: str, reason: str = "", retry_in_s: float | None = None,
             has_state: bool = True) -> None:
        self.display = not connected
        if not connected:
            retry = f"; retrying in {fmt_s(retry_in_s)}" if retry_in_s is not None else ""
            what = "disconnected from" if has_state else "cannot reach"
            shown = " (last state shown)" if has_state else ""
            self.update(Content(f"{what} {url}: {reason}{retry}{shown}"))


def reached_line(ledgers: dict) -> str:
    """`tp0: rank 0 #12, rank 1 #11 · pp0: ...`: the newest collective (p2p: op) sequence number each rank's
    ledger holds, per group; from {rank: Ledger}."""
    per: dict[tuple[str, bool], dict[int, int]] = {}
    names: dict[str, str] = {}
    for rank, led in sorted(ledgers.items()):
        names.update({g.name: g.desc for g in led.groups})
        for e in led.entries:
            key = (e.group, e.op in ("send", "recv"))
            per.setdefault(key, {})[rank] = max(per.get(key, {}).get(rank, 0), e.seq)
    parts = [f"{names.get(g, g)}{' p2p' if p2p else ''}: " + ", ".join(f"rank {r} #{q}" for r, q in sorted(seen.items()))
             for (g, p2p), seen in sorted(per.items())]
    return " · ".join(parts)


class HangPanel(Static):
    """The hang view: which ranks wait for whom, and the rank at the end of the chain."""

    reached: str | None = None   # per group, the sequence number each rank has reached (from the ledgers)
    straggler: str = ""          # a rank not hung that is consistently late (hang.straggler_note), from the ledgers

    def show(self, waits: list[Wait], detected: str | None = None, stalls: list[str] = ()) -> None:
        """`detected`: the hang the engine's detector reported, until its step went on (EngineStats.hang), shown while
        anyone waits. `stalls`: the requests the stall detector named that still do not get on (EngineStats.stalls):
        shown while they hold, ranks waiting or not (`devharness requests ID` tells the request's story)."""
        self.display = bool(waits or stalls)
        lines = [Content.assemble((f"{fmt_s(w.waiting_s):>8} ", "$warning bold"), w.describe(),
                                  (f"  · in {w.phase}" + (f", {w.detail}" if w.detail else ""), "dim"))
                 for w in waits]
        roots = root_blockers(waits)
        if len(waits) > 1 and roots:
            lines.insert(0, Content.assemble(("root cause: ", "$error bold"),
                                             ", ".join(f"rank {b.rank} ({b.why})" for b in roots)))
        if detected:
            lines.insert(0, Content.assemble(("detected: ", "$error bold"), detected))
        if self.straggler and self.straggler not in (detected or ""):
            lines.append(Content.assemble(("straggler: ", "$warning bold"), self.straggler))
        if self.reached:
            lines.append(Content.assemble(("reached: ", "bold"), self.reached))
        lines += [Content.assemble(("stall: ", "$warning bold"), s) for s in stalls]
        self.update(Content("\n").join(lines))


class PromptTrace(Static):
    """A test prompt's trip: which PP stages it has reached while in flight, then its answer."""

    def start(self, prompt: str, pp_stages: list[int], now: float) -> None:
        self.display = True
        self._prompt, self._started, self._result = prompt, now, None
        self._stages: dict[int, tuple[bool, str]] = {pp: (False, "") for pp in pp_stages}
        self._redraw(now)

    def observe(self, snapshot: Snapshot, now: float) -> None:
        """Mark the stages busy with requests now; other traffic counts too, so this is a
        picture of the pipeline moving, not a per-request trace."""
        if not self.display or self._result is not None:
            return
        for pp in sorted({w.pp_rank for w in snapshot.workers}):
            busy = [effective_phase(w) for w in snapshot.workers if w.pp_rank == pp and w.num_reqs > 0
                    and effective_phase(w) not in ("idle", "dead")]
            seen = self._stages.get(pp, (False, ""))[0] or bool(busy)
            self._stages[pp] = (seen, busy[0] if busy else "")
        self._redraw(now)

    def finish(self, result: Completion | str, now: float) -> None:
        self._result = result
        self._redraw(now)

    def _redraw(self, now: float) -> None:
        stages = []
        for pp, (seen, phase) in sorted(self._stages.items()):
            if phase and self._result is None:
                mark = ("● " + phase, PHASE_STYLE.get(phase, ""))
            else:
                mark = ("✓", "$success") if seen else ("·", "dim")
            stages.append(Content.assemble((f"pp{pp} ", "bold"), mark))
        route = Content(" → ").join(stages)
        took = fmt_s(now - self._started)
        if self._result is None:
            status = Content.assemble(("test prompt ", "bold"), f"in flight {took}  ")
        elif isinstance(self._result, str):
            status = Content.assemble(("test prompt failed: ", "$error bold"), self._result, "  ")
        else:
            n = "?" if self._result.num_tokens is None else self._result.num_tokens
            status = Content.assemble(("test prompt ✓ ", "$success bold"), f"{n} tokens in {took}: ",
                                      (repr(self._result.text[:60]), "italic"), "  ")
        self.update(status + route)
