"""README.md and docs/ stay true to the code and to each other: the flag table of docs/cli.md names every flag of
every command (read from the CLI's own parser) and none a command lacks; README.md stays a front door (at most
README_MAX_LINES lines); every relative link in README.md and docs/*.md reaches a file that exists."""
import argparse
import re
from pathlib import Path

from devharness.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLI_DOC = ROOT / "docs" / "cli.md"
README_MAX_LINES = 250
ENGINE = ("generate", "serve", "check", "bench throughput", "bench debug-overhead", "bench restart", "bench load",
          "bench single-stream")


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


def documented_flags() -> set[tuple[str, str]]:
    """(command, flag) for every row of docs/cli.md's flag table: `| \`--flag ARG\` | commands | ... |`."""
    found: set[tuple[str, str]] = set()
    text = CLI_DOC.read_text()
    assert "\n## Every flag\n" in text, "docs/cli.md has no '## Every flag' section"
    section = re.split(r"\n#{1,2} ", text.split("\n## Every flag\n", 1)[1], maxsplit=1)[0]
    for line in section.splitlines():
        if not line.startswith("| `-"):
            continue
        flags_cell, commands_cell = (cell.strip() for cell in line.strip("|").split("|")[:2])
        flags = [code.split()[0] for code in re.findall(r"`([^`]+)`", flags_cell)]
        commands = [c.strip() for c in commands_cell.split(",")]
        commands = [e for c in commands for e in (ENGINE if c == "engine" else (c,))]
        found.update((c, f) for c in commands for f in flags)
    return found


def test_the_flag_table_names_every_flag_of_every_command():
    in_code, in_doc = parser_flags(), documented_flags()
    assert len(in_code) > 100
    missing = sorted(in_code - in_doc)
    assert missing == [], f"docs/cli.md's flag table ('## Every flag') lacks these (command, flag): {missing}"
    stale = sorted(in_doc - in_code)
    assert stale == [], f"docs/cli.md's flag table names flags these commands do not have: {stale}"


def test_the_readme_is_a_front_door():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}): move reference "
                                       f"material into docs/ and link to it")


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(text: str) -> list[str]:
    """The targets of the Markdown links and images in `text` that point into the repository: fenced code blocks
    and code spans left out, web addresses and in-page anchors skipped, a target's #fragment dropped."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def broken_links(path: Path) -> list[str]:
    return [t for t in relative_links(path.read_text()) if not (path.parent / t).exists()]


def test_every_relative_link_reaches_a_file():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    assert CLI_DOC in pages and len(pages) >= 5
    assert sum(len(relative_links(p.read_text())) for p in pages) >= 10   # the reader sees the links
    broken = {str(p.relative_to(ROOT)): b for p in pages if (b := broken_links(p))}
    assert broken == {}, f"relative links to files that do not exist: {broken}"


def test_the_link_check_can_fail():
    text = ("[a](docs/cli.md) ![b](docs/tui.svg \"t\") [c](https://example.com/x.md) [d](#here)"
            " [e](docs/cli.md#every-flag)\n`[f](no-such-file.md)`\n```\n[g](no-such-file.md)\n```\n"
            "[h](docs/no-such-file.md)")
    assert relative_links(text) == ["docs/cli.md", "docs/tui.svg", "docs/cli.md", "docs/no-such-file.md"]
    assert [t for t in relative_links(text) if not (ROOT / t).exists()] == ["docs/no-such-file.md"]


def test_the_engine_flag_rows_are_made_from_the_config_fields():
    from devharness.engine.args import flag_table
    rows = flag_table()
    assert rows.count("\n") > 25 and "| `--tp N` | engine | 1 | tensor parallel size |" in rows
    assert rows in CLI_DOC.read_text(), ("docs/cli.md's engine flags are not the config fields': paste the rows "
                                         "`python -m devharness.engine.args` prints under '### Engine flags'")


BENCH_DOC = ROOT / "docs" / "benchmarks.md"


def bench_sections(text: str) -> dict[str, list[str]]:
    """docs/benchmarks.md's sections: heading ("devharness bench NAME ...") -> the command lines of its code blocks."""
    out = {}
    for part in re.split(r"\n## ", text)[1:]:
        heading, _, body = part.partition("\n")
        out[heading.strip()] = [line.strip() for block in re.findall(r"```bash\n(.*?)```", body, re.S)
                                for line in block.splitlines() if line.strip()]
    return out


def bench_commands_without_a_section(text: str) -> list[str]:
    """Every `devharness bench` command the CLI has, and the pipeline comparison, needs a section of its own whose
    commands print it with --markdown (so each table is one command's output, dated): those that have none."""
    bench = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    names = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices
    wanted = [f"devharness bench {n}" for n in names] + ["devharness bench throughput --pipeline"]
    sections = bench_sections(text)
    return [w for w in wanted if not (sections.get(w) and
                                      all(c.startswith(w) and "--markdown" in c.split() for c in sections[w]))]


def test_every_bench_has_its_section_printed_by_its_markdown():
    assert bench_commands_without_a_section(BENCH_DOC.read_text()) == []
    # The check can fail: a section whose command does not print --markdown, and a bench with no section.
    text = BENCH_DOC.read_text()
    assert bench_commands_without_a_section(text.replace("devharness bench load --clients 200 --requests-per-client "
                                                         "4 --markdown", "devharness bench load")) == \
        ["devharness bench load"]
    assert bench_commands_without_a_section(text.replace("## devharness bench executor", "## Executors")) == \
        ["devharness bench executor"]
