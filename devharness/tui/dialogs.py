"""The TUI's modal screens: where to break a rank, and the help with keys and colours."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from devharness.tui.widgets import PHASE_STYLE, SLOW_S, STUCK_S


class BreakDialog(ModalScreen[tuple[int | None, int | None] | None]):
    """Asks where to break a rank: a step and/or a layer; both empty means its next step."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, rank: int) -> None:
        super().__init__()
        self._rank = rank

    def compose(self) -> ComposeResult:
        with Vertical(id="break-dialog"):
            yield Static(f"Break rank {self._rank} at (Enter arms, Esc cancels)")
            yield Input(placeholder="step (empty: next)", type="integer", id="break-step")
            yield Input(placeholder="layer (empty: step start)", type="integer", id="break-layer")

    def on_input_submitted(self) -> None:
        step, layer = (self.query_one(f"#break-{f}", Input).value.strip() for f in ("step", "layer"))
        self.dismiss((int(step) if step else None, int(layer) if layer else None))


class HelpScreen(ModalScreen[None]):
    """Keys, colours and thresholds."""

    BINDINGS = [Binding("escape,question_mark,q", "dismiss(None)", "Close")]
    KEYS = ("arrows, click  select a worker", "p  pause / resume the engine",
            "s  one engine step (while paused)", "b  break the selected rank at its next step",
            "B  break it at a step and/or layer", "t  take its Python stacks",
            "f  fold / unfold Ray's and the debugger's threads",
            "g  send a test prompt", "c  copy its VS Code attach configuration",
            "r  release it (paused, no debugger attached)", "R  release every paused rank",
            "d  write a bundle (steps, states, stacks)", "k  the KV cache: blocks, tables, events",
            "w  the requests: why each waits, its story", "l  the timeline: ranks over the last steps",
            "?  this help", "q  quit")

    def compose(self) -> ComposeResult:
        keys = "\n".join(f"{a:<38}{b}" for a, b in zip(self.KEYS[::2], self.KEYS[1::2]))
        legend = "  ".join(f"[{s}]{p}[/]" for p, s in PHASE_STYLE.items())
        yield Static(f"[b]devharness tui[/b]\n\n{escape(keys)}\n\nphases: {legend}\ntime in phase: "
                     f"yellow past {SLOW_S:.0f} s, red past {STUCK_S:.0f} s; the hang view then names\n"
                     "the rank a stuck worker waits for.  [dim]Esc closes[/]", id="help-text")
