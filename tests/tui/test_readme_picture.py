"""The README's picture of the TUI is what the TUI draws today: docs/tui.svg, rendered again from the same
canned tp=2 x pp=2 snapshot (tests/tui/readme_picture.py), says the same text."""
from pathlib import Path

from tests.tui.readme_picture import PICTURE, REFRESH, render, text_lines

README = Path(__file__).resolve().parents[2] / "README.md"


async def test_the_readme_picture_is_current():
    assert "](docs/tui.svg)" in README.read_text()
    now = text_lines(await render())
    assert any("rank 1 · tp 1 pp 0" in line for line in now) and any("attention.py:55" in line for line in now)
    assert PICTURE.exists(), f"docs/tui.svg is missing: run `{REFRESH}`"
    assert text_lines(PICTURE.read_text()) == now, f"docs/tui.svg is out of date: run `{REFRESH}` and commit it"
