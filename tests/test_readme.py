"""README.md stays true to the code: its flag table names every flag of every command (read from the CLI's
own parser) and none a command lacks."""
import argparse
import re
from pathlib import Path

from devharness.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
ENGINE = ("generate", "serve", "check", "bench throughput", "bench debug-overhead", "bench restart", "bench load")


def parser_flags() -> set[tuple[str, str]]:
    """(command, flag) for every optional argument; the top-level parser's command is "devharness"."""
    found: set[tuple[str, str]] = set()

    def walk(parser: argparse.ArgumentParser, command: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{command} {name}".strip())
            elif not isinstance(action, argparse._HelpAction):
                found.update((command or "devharness", flag) for flag in action.option_strings)

    walk(build_parser(), "")
    return found


def readme_flags() -> set[tuple[str, str]]:
    """(command, flag) for every row of the README's flag table: `| \\`--flag ARG\\` | commands | ... |`."""
    found: set[tuple[str, str]] = set()
    text = README.read_text()
    assert "\n### Every flag\n" in text, "README.md has no '### Every flag' section"
    section = text.split("\n### Every flag\n", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        if not line.startswith("| `-"):
            continue
        flags_cell, commands_cell = (cell.strip() for cell in line.strip("|").split("|")[:2])
        flags = [code.split()[0] for code in re.findall(r"`([^`]+)`", flags_cell)]
        commands = [c.strip() for c in commands_cell.split(",")]
        commands = [e for c in commands for e in (ENGINE if c == "engine" else (c,))]
        found.update((c, f) for c in commands for f in flags)
    return found


def test_the_readme_table_names_every_flag_of_every_command():
    in_code, in_readme = parser_flags(), readme_flags()
    assert len(in_code) > 100
    missing = sorted(in_code - in_readme)
    assert missing == [], f"README.md's flag table ('### Every flag') lacks these (command, flag): {missing}"
    stale = sorted(in_readme - in_code)
    assert stale == [], f"README.md's flag table names flags these commands do not have: {stale}"
