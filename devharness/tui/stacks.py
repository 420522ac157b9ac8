"""A worker's Python stacks (a py-spy dump) arranged for reading: the step thread first, devharness's
frames bright and everything else dim, and the threads that are only Ray's or the debugger's own folded
into one line.

A worker in debug mode has a dozen threads and one that matters: the one running the step (the main
thread under mp, a Ray task thread under Ray). The rest wait in Ray's core worker, in pydevd's reader
and writer, in a queue: worth a glance when something is wrong with them, noise otherwise. Pure
functions of the dump's text, so they are tested without an app.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from textual.content import Content

# py-spy dump: `Thread 18595 (idle): "Dummy-7"`, then one frame a line: `    func (path/file.py:58)`.
_THREAD = re.compile(r'^Thread \S+ \([^)]*\)(?:: "(?P<name>.*)")?\s*$')
_FRAME = re.compile(r"^\s+(?P<func>\S.*?) \((?P<file>[^():]+?)(?::(?P<line>\d+))?\)\s*$")

# Where a frame is plumbing: Ray's worker, the debugger, the threads and queues they wait in. py-spy
# names files relative to the sys.path entry they came from.
_PLUMBING = re.compile(r"(^|/)(ray|debugpy|_pydevd_bundle|_pydev_bundle|_pydevd_frame_eval|pydevd_plugins|"
                       r"concurrent|multiprocessing|grpc|asyncio)/|(^|/)(pydevd\w*|threading|queue|selectors|"
                       r"socket|socketserver|<string>)(\.py)?$")
# Threads that are the debugger's own even where a frame is ours (our watcher lives in debug/debugger.py).
_DEBUGGER_THREAD = re.compile(r"^(pydevd\.|devharness-debug-watcher$)")
# The frames only the step thread has: the worker's loop and its step.
_STEP_FRAME = re.compile(r"(^|/)devharness/worker/")


def is_ours(file: str) -> bool:
    return file.startswith("devharness/") or "/devharness/" in file


@dataclass
class Frame:
    func: str
    file: str
    line: int | None

    @property
    def ours(self) -> bool:
        return is_ours(self.file)


@dataclass
class Thread:
    """One thread of the dump: its header line, its frames (innermost first) and any line that is not a
    frame (py-spy's --locals, another tool's format), kept in order as text."""

    header: str
    name: str
    lines: list[Frame | str] = field(default_factory=list)

    @property
    def frames(self) -> list[Frame]:
        return [x for x in self.lines if isinstance(x, Frame)]

    @property
    def is_step(self) -> bool:
        return any(_STEP_FRAME.search(f.file) for f in self.frames)

    @property
    def foldable(self) -> bool:
        """Ray's or the debugger's own: named as the debugger's, or nothing in it but plumbing."""
        if _DEBUGGER_THREAD.match(self.name):
            return True
        return all(isinstance(x, Frame) and _PLUMBING.search(x.file) for x in self.lines)


@dataclass
class Stacks:
    """A dump parsed: the lines before the first thread (py-spy's process line), the threads to show
    (the step thread first, then those with devharness frames) and those folded."""

    preamble: list[str]
    shown: list[Thread]
    folded: list[Thread]


def parse(text: str) -> Stacks:
    preamble: list[str] = []
    threads: list[Thread] = []
    for raw in text.splitlines():
        if m := _THREAD.match(raw):
            threads.append(Thread(raw, m.group("name") or ""))
        elif not threads:
            preamble.append(raw)
        elif m := _FRAME.match(raw):
            line = m.group("line")
            threads[-1].lines.append(Frame(m.group("func"), m.group("file"), int(line) if line else None))
        elif raw.strip():
            threads[-1].lines.append(raw)
    while preamble and not preamble[-1].strip():
        preamble.pop()
    shown = [t for t in threads if not t.foldable]
    # Stable: the step thread, then threads running our code, then the rest, each in the dump's order.
    shown.sort(key=lambda t: (not t.is_step, not any(f.ours for f in t.frames)))
    return Stacks(preamble, shown, [t for t in threads if t.foldable])


OURS_STYLE = "bold $accent"
STEP_STYLE = "bold $success"


def render(stacks: Stacks, unfold: bool = False) -> Content:
    """The arranged dump as styled text; `unfold` shows the folded threads too, after the others."""
    threads = stacks.shown + (stacks.folded if unfold else [])
    if not threads and not stacks.folded:   # no thread found: not a py-spy dump, shown as it came
        return Content("\n".join(stacks.preamble))
    out = [Content.styled(line, "dim") for line in stacks.preamble]
    if out:
        out.append(Content(""))
    for i, thread in enumerate(threads):
        if thread.is_step:
            out.append(Content.assemble(("▶ step thread  ", STEP_STYLE), (thread.header, "bold")))
        else:
            out.append(Content.styled(thread.header, "bold" if i < len(stacks.shown) else "dim bold"))
        for x in thread.lines:
            if isinstance(x, str):
                out.append(Content(x))
            else:
                where = x.file if x.line is None else f"{x.file}:{x.line}"
                out.append(Content.styled(f"    {x.func} ({where})", OURS_STYLE if x.ours else "dim"))
    if stacks.folded:
        names = ", ".join(t.name or "?" for t in stacks.folded)
        n = len(stacks.folded)
        what = f"{n} Ray/debugger thread{'s' if n != 1 else ''}"
        out.append(Content.styled(f"− {what} shown last (f folds them)" if unfold else
                                  f"+ {what} folded: {names} (f unfolds)", "italic dim"))
    return Content("\n").join(out)
