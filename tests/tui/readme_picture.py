"""The README's picture of the TUI (docs/tui.svg): a tp=2 x pp=2 tiny-llama run in debug mode, rank 1
stopped at a breakpoint in attention with VS Code attached, rank 0 waiting for it in layer 1's
all-reduce, stage 1 waiting for stage 0's hidden states. Canned snapshots and a frozen clock (as the
snapshot tests), so the picture changes only when the TUI does.

Refresh it:  python -m tests.tui.readme_picture
"""
from __future__ import annotations

import asyncio
import html
import re
from pathlib import Path

from devharness.protocol.messages import DebugpyInfo, EngineStats, PausedInfo, Snapshot, StepRecord
from tests.tui.test_tui import NOW, FakeClient, _settled, make_app, worker

PICTURE = Path(__file__).resolve().parents[2] / "docs" / "tui.svg"
SIZE = (120, 34)
REFRESH = "python -m tests.tui.readme_picture"

AT_BREAKPOINT = PausedInfo(reason="breakpoint", file="/src/devharness/model/attention.py", line=55, since=NOW - 42)
RUN = Snapshot(engine=EngineStats(step=5, state="running", num_running=2, num_waiting=0), workers=[
    worker(0, step=5, phase="collective", detail="layer 1 attention all_reduce", phase_since=NOW - 42,
           waiting_for=[1], num_reqs=2, num_tokens=2, kv_blocks_used=2),
    worker(1, step=5, phase="paused", detail="layer 1 attention", paused=AT_BREAKPOINT, num_reqs=2,
           num_tokens=2, kv_blocks_used=2, debugpy=DebugpyInfo(port=5679, client_connected=True)),
    worker(2, step=5, phase="recv", detail="hidden states", phase_since=NOW - 42, waiting_for=[0, 1],
           num_reqs=2, num_tokens=2, kv_blocks_used=2),
    worker(3, step=5, phase="recv", detail="hidden states", phase_since=NOW - 42, waiting_for=[0, 1],
           num_reqs=2, num_tokens=2, kv_blocks_used=2)])
HISTORY = [StepRecord(step=s, phases={"prepare": 0.4, "forward": 3.1 + (s == 1) * 4.0, "collective": 1.2,
                                      "sample": 0.3}) for s in range(1, 5)]


async def render() -> str:
    """The SVG Textual exports of that view."""
    app = make_app(FakeClient(RUN, history=HISTORY))
    async with app.run_test(size=SIZE) as pilot:
        await _settled(pilot)
        return app.export_screenshot(title="devharness tui")


def text_lines(svg: str) -> list[str]:
    """What the picture says, line by line: the text of its <text> elements grouped by row (the ids and
    styles Textual writes around them are left out, so only a change one can read counts)."""
    rows: dict[float, list[tuple[float, str]]] = {}
    for attrs, text in re.findall(r"<text ([^>]*)>(.*?)</text>", svg, flags=re.S):
        x, y = (re.search(rf'\b{k}="([-\d.]+)"', attrs) for k in ("x", "y"))
        if x and y:
            rows.setdefault(float(y[1]), []).append((float(x[1]), html.unescape(text).replace("\xa0", " ")))
    return ["".join(t for _, t in sorted(row)).rstrip() for _, row in sorted(rows.items())]


if __name__ == "__main__":
    PICTURE.parent.mkdir(exist_ok=True)
    PICTURE.write_text(asyncio.run(render()), encoding="utf-8")
    print(f"wrote {PICTURE}")
