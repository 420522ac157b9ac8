"""The detail pane: the selected worker's step timeline, Python stacks, logs, last collectives and VS Code
attach configuration."""
from __future__ import annotations

import json

from textual.app import ComposeResult
from textual.containers import ScrollableContainer, Vertical
from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Static, TabbedContent, TabPane

from devharness.protocol.messages import Ledger, StepRecord, WorkerState
from devharness.tui import stacks as stack_view
from devharness.tui.widgets import PHASE_STYLE

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class StepTimeline(Widget):
    """The selected worker's last steps, one row each, as bars split by phase duration."""

    steps: reactive[tuple[StepRecord, ...] | None] = reactive(())   # None: no history route

    def render(self) -> Content:
        if self.steps is None:
            return Content.styled("step history not available from this server", "dim")
        if not self.steps:
            return Content.styled("no steps yet", "dim")
        rows = self.steps[-max(1, self.content_size.height - 1):]
        totals = [r.total_ms if r.total_ms is not None else sum(r.phases.values()) for r in rows]
        label_w = len(str(max(r.step for r in rows)))
        bar_w = max(10, self.content_size.width - label_w - 12)
        scale = bar_w / (max(totals) or 1.0)
        # The legend leaves out phases too short to draw (workers log a few µs of "idle" as a
        # step starts), so it names only colours that appear in the bars.
        names = [p for p in dict.fromkeys(p for r in rows for p in r.phases)
                 if any(r.phases.get(p, 0.0) * scale >= 0.5 for r in rows)]
        lines = [Content.assemble(*[("■ " + p + "  ", PHASE_STYLE.get(p, "")) for p in names])]
        for r, total in zip(rows, totals):
            parts, cum, drawn = [(f"{r.step:>{label_w}} ", "dim")], 0.0, 0
            for phase, ms in r.phases.items():
                cum += ms
                end = round(cum * scale)   # round the running sum so rows don't drift apart
                parts.append(("█" * (end - drawn), PHASE_STYLE.get(phase, "")))
                drawn = end
            parts.append(" " * max(0, bar_w - drawn) + f" {total:7.1f} ms")
            lines.append(Content.assemble(*parts))
        return Content("\n").join(lines)


def ledger_lines(led: Ledger | None, rows: int = 40) -> str:
    """A rank's last collectives, newest last: sequence number, group, op, shape, dtype, where, state."""
    if led is None:
        return "the collective ledger is not available from this server"
    if not led.entries:
        return "no collectives yet"
    desc = {g.name: g.desc for g in led.groups}
    lines = [f"{led.count} ops in all ({led.backend}{', async' if led.async_ops else ''}); the last {rows}:"]
    for e in led.entries[-rows:]:
        peer = f" {'to' if e.op == 'send' else 'from'} {e.peer}" if e.peer is not None else ""
        lines.append(f"{desc.get(e.group, e.group):>5} #{e.seq:<6} step {e.step:<5} {e.op}{peer} "
                     f"{'x'.join(map(str, e.in_shape))} {e.in_dtype}  {e.where()}  {e.state}")
    return "\n".join(lines)


def attach_config(w: WorkerState) -> str:
    """A VS Code launch.json "attach" configuration for one rank (JSONC, as launch.json is)."""
    d = w.debugpy
    if d is None or d.port is None:
        return f"// rank {w.rank} has no debugpy listener: start the server with --debug"
    config = {"name": f"devharness rank {w.rank} (tp {w.tp_rank}, pp {w.pp_rank})",
              "type": "debugpy", "request": "attach",
              "connect": {"host": d.host, "port": d.port},
              "pathMappings": [{"localRoot": "${workspaceFolder}",
                                "remoteRoot": w.source_root or "${workspaceFolder}"}],
              "justMyCode": False}
    lines = ['// add to "configurations" in .vscode/launch.json (c copies it)']
    if d.host in LOOPBACK and w.node_ip not in LOOPBACK:
        lines.append(f"// if {w.node_ip} is another machine: ssh -N -L {d.port}:127.0.0.1:{d.port} {w.node_ip}")
    return "\n".join(lines + [json.dumps(config, indent=2)])


class DetailPane(Vertical):
    """The selected worker: step timeline, Python stacks, log lines, its last collectives, VS Code attach snippet."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._dump: tuple[str, stack_view.Stacks] | None = None   # the stacks shown, with their title
        self._unfold = False   # whether Ray's and the debugger's threads are shown too (f)

    def compose(self) -> ComposeResult:
        # Kept by reference: a worker finishing during shutdown must not fail on a query.
        self._title = Static("select a worker", id="detail-title", markup=False)
        self._timeline = StepTimeline()
        self._stack = Static("press t to take this worker's stacks", id="stack-text", markup=False)
        self._logs = Static("", id="log-text", markup=False)
        self._attach = Static("", id="attach-text", markup=False)
        self._collectives = Static("", id="collectives-text", markup=False)
        yield self._title
        with TabbedContent(id="detail-tabs") as self.tabs:
            with TabPane("Timeline", id="tab-timeline"):
                yield self._timeline
            for title, body in (("Stack", self._stack), ("Logs", self._logs), ("Collectives", self._collectives),
                                ("Attach", self._attach)):
                with TabPane(title, id=f"tab-{title.lower()}"), ScrollableContainer():
                    yield body

    def show_worker(self, w: WorkerState) -> None:
        self._title.update(f"rank {w.rank} · tp {w.tp_rank} · pp {w.pp_rank} · {w.node_ip} pid {w.pid}")
        self._attach.update(attach_config(w))

    def show_history(self, steps: list[StepRecord] | None) -> None:
        self._timeline.steps = None if steps is None else tuple(steps)

    def show_stack(self, text: str) -> None:
        """A line about the stacks (press t, taking them, failed) in place of a dump."""
        self._dump = None
        self._stack.update(text)

    def show_dump(self, title: str, dump: str) -> None:
        """A worker's stacks (py-spy's text), step thread first, Ray's and the debugger's threads folded."""
        self._dump = (title, stack_view.parse(dump))
        self._render_dump()

    def toggle_fold(self) -> None:
        self._unfold = not self._unfold
        if self._dump is not None:
            self._render_dump()

    def _render_dump(self) -> None:
        title, parsed = self._dump
        self._stack.update(Content("\n\n").join([Content(title), stack_view.render(parsed, self._unfold)]))

    def show_collectives(self, led: Ledger | None) -> None:
        self._collectives.update(ledger_lines(led))

    def show_logs(self, lines: list[str] | None) -> None:
        self._logs.update("logs not available from this server" if lines is None else "\n".join(lines[-200:]))
