"""`devharness bench <name> --markdown`: after its run, a bench prints its section of docs/benchmarks.md as it
stands there: a line naming the machine and today's date, then its tables (and the sentences between them), so
that updating the docs is one command per section. Written once here, for every bench."""
from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Sequence


def add_flag(parser) -> None:
    parser.add_argument("--markdown", action="store_true",
                        help="after the run, print its section of docs/benchmarks.md: the machine, the date, the "
                             "tables in Markdown")


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() in ("model name", "Model", "Hardware"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(note: str = "", today: datetime.date | None = None) -> str:
    """"<CPU>, <n> vCPUs, torch <version>, <threads> threads[, note]; <date>." (torch's threads in this process)."""
    import torch
    version = torch.__version__.split("+")[0]
    threads = torch.get_num_threads()
    return (f"{cpu_name()}, {os.cpu_count()} vCPUs, torch {version}, {threads} thread{'s' * (threads != 1)}"
            f"{', ' + note if note else ''}; {(today or datetime.date.today()).isoformat()}.")


class Table:
    """A Markdown table: a header row, a rule (`align`: per column "l" or "r"; default all left) and rows of cells."""

    def __init__(self, header: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None):
        if any(len(r) != len(header) for r in rows):
            raise ValueError(f"a row of the table {list(header)} has not {len(header)} cells")
        self.header, self.rows = list(header), [list(r) for r in rows]
        self.align = align or "l" * len(header)

    def lines(self) -> list[str]:
        rule = "|" + "|".join("---:" if a == "r" else "---" for a in self.align) + "|"
        return [row(self.header), rule] + [row(r) for r in self.rows]


def row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def print_section(blocks: Sequence[Table | str], note: str = "") -> None:
    """The machine line, then each block (a Table, or a paragraph of text), a blank line between them."""
    print()
    print(machine_line(note))
    for block in blocks:
        print()
        print("\n".join(block.lines()) if isinstance(block, Table) else block)


def ratio(x: float, digits: int = 2) -> str:
    """A ratio as the docs write it: 1.21×."""
    return f"{x:.{digits}f}×"


def parse_table(text: str, header: Sequence[str]) -> list[list[str]]:
    """The rows of the Markdown table in `text` whose header is `header` (for tests and scripts that read the
    output back): each row's cells, stripped. ValueError where no such table is."""
    lines = text.splitlines()
    head = row(header)
    if head not in lines:
        raise ValueError(f"no table with the header {head!r}")
    i = lines.index(head) + 2
    rows = []
    while i < len(lines) and lines[i].startswith("|"):
        rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
        i += 1
    return rows
