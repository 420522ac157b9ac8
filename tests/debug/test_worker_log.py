"""A worker's log file: what it prints and logs, read back by the driver; bounded in size."""
import subprocess
import sys
import uuid

import pytest

from devharness.debug import state, worker_log

CHILD = """
import logging, sys
logging.basicConfig(level=logging.WARNING)
from devharness.debug import worker_log
worker_log.capture(sys.argv[1], 3)
print("printed line")
logging.getLogger("devharness.test").info("info record")
logging.getLogger("devharness.test").warning("warning record")
from devharness.debug.redact import add_secret
add_secret("registered-secret-value")
print("argv: serve --api-key flag-secret-value key registered-secret-value")
"""


@pytest.fixture
def run_id():
    rid = f"test-{uuid.uuid4().hex[:8]}"
    yield rid
    state.remove_run_files(rid)


def test_prints_and_records_reach_the_file_once_and_the_console_as_before(run_id):
    res = subprocess.run([sys.executable, "-c", CHILD, run_id], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("printed line") == 1
    assert res.stderr.count("warning record") == 1 and "info record" not in res.stderr   # console: WARNING up
    lines = worker_log.tail(worker_log.log_path(run_id, 3))
    text = "\n".join(lines)
    assert [text.count(s) for s in ("printed line", "info record", "warning record")] == [1, 1, 1], lines
    assert any("INFO devharness.test: info record" in line for line in lines)
    # A secret printed reaches the console, never the file (debug/redact.py); the file is its user's alone.
    assert "flag-secret-value" in res.stdout and "registered-secret-value" in res.stdout
    assert "argv: serve --api-key <redacted> key <redacted>" in lines, lines
    assert worker_log.log_path(run_id, 3).stat().st_mode & 0o777 == 0o600


def test_the_file_starts_over_past_its_size_and_tail_reads_across(run_id, monkeypatch):
    monkeypatch.setattr(worker_log, "MAX_BYTES", 4000)
    path = worker_log.log_path(run_id, 0)
    log = worker_log._LogFile(path)
    for i in range(1000):
        log.write(f"line {i}\n")
    log.close()
    assert path.stat().st_size < 4100 and path.with_name(path.name + ".1").exists()
    assert {p.stat().st_mode & 0o777 for p in (path, path.with_name(path.name + ".1"))} == {0o600}
    assert worker_log.tail(path, 300) == [f"line {i}" for i in range(700, 1000)]
    assert worker_log.tail(path, 5) == [f"line {i}" for i in range(995, 1000)]
    assert worker_log.tail(worker_log.log_path(run_id, 7)) == []
