"""Every script in examples/ (but the helpers named _*.py) runs in a fresh interpreter, as a user runs
it, and exits 0: each checks its own story's outcome and exits non-zero when it does not come out.
Found by glob, so a new example is run without touching this file. Two run at a time (each is mostly
process start-up and waiting on its workers), so the examples cost about half their sum."""
import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))


def test_there_are_examples_and_the_readme_names_each():
    assert len(EXAMPLES) >= 5, EXAMPLES
    readme = (ROOT / "README.md").read_text()
    assert [p.name for p in EXAMPLES if f"examples/{p.name}" not in readme] == []


def run_example(example: Path, tmp: Path) -> subprocess.CompletedProcess:
    # TMPDIR: recordings and bundles an example leaves go into pytest's temporary directory.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "TMPDIR": str(tmp)}
    return subprocess.run([sys.executable, str(example)], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every example started at once on a pool of two: {example: future of its finished process}."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        yield {p: pool.submit(run_example, p, tmp_path_factory.mktemp(p.stem)) for p in EXAMPLES}


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_tells_its_story(example, runs):
    res = runs[example].result()
    assert res.returncode == 0, f"{example.name} exited {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
