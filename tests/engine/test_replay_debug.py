"""`devharness replay DIR --debug --break-at-step N --break-rank R`: rank R of the replay stops at the
recorded step N and waits for a debugger; a DAP client attached to its port sees it stopped in devharness
code at that step, and once it continues the replay ends with its usual verdict. Bad combinations of the
flags are one line, exit 2, before any worker starts."""
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import devharness
from devharness import LLM, SamplingParams
from devharness.cli import main
from devharness.protocol.recording import read_recording
from devharness.engine.replay import replay
from tests.debug.dap_client import DAPClient
from tests.helpers import free_port_base, wait_until

PACKAGE = os.path.dirname(os.path.abspath(devharness.__file__))
BREAK_STEP = 3


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """A short run on uni (the quickest to record); the replay runs it on tp=2."""
    d = tmp_path_factory.mktemp("rec") / "run"
    with LLM(model="tiny-llama", distributed_executor_backend="uni", num_kv_blocks=16, record_dir=str(d)) as llm:
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}],
                     SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    steps = [s.scheduler_output.step for s in read_recording(d).steps]
    assert steps == [1, 2, 3, 4, 5], steps
    return d


@pytest.mark.parametrize("flags, message", [
    (["--break-at-step", "3"], "needs --debug"),
    (["--debug", "--break-at-step", "6"], "the recording holds steps 1..5"),
    (["--debug", "--break-at-step", "0"], "the recording holds steps 1..5"),
    (["--debug", "--tp", "2", "--break-at-step", "3", "--break-rank", "2"], "this replay has ranks 0..1"),
    (["--debug", "--break-at-step", "3", "--break-rank", "1"], "this replay has ranks 0..0"),
    (["--debug", "--break-rank", "0"], "needs --break-at-step"),
    (["--port", "0"], "needs --debug"),
])
def test_bad_break_flags_are_one_line(recording, capsys, flags, message):
    assert main(["replay", str(recording), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_bad_break_arguments_are_value_errors(recording):
    with pytest.raises(ValueError, match="needs --debug"):
        replay(recording, break_at_step=3)
    with pytest.raises(ValueError, match="ranks 0..1"):
        replay(recording, tensor_parallel_size=2, debug=True, break_at_step=3, break_rank=5)


def test_replay_stops_rank1_at_the_step_for_a_debugger(recording, tmp_path):
    base = free_port_base(2)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(PACKAGE).parent),
                                                                     os.environ.get("PYTHONPATH")]))}
    # Output goes to files: debugpy's adapter processes inherit them and may outlive the replay.
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen([sys.executable, "-m", "devharness.cli", "replay", str(recording), "--tp", "2",
                                 "--executor", "mp", "--threads-per-worker", "1", "--debug",
                                 "--debug-port-base", str(base), "--break-at-step", str(BREAK_STEP),
                                 "--break-rank", "1", "--port", "0"], stdout=fo, stderr=fe, env=env, cwd=tmp_path)
    client = url = None
    try:
        stop = f"rank 1 will stop at step {BREAK_STEP}"
        wait_until(lambda: stop in err.read_text() or proc.poll() is not None, 120, "the attach line")
        assert proc.poll() is None, err.read_text()
        line = next(ln for ln in err.read_text().splitlines() if stop in ln)
        assert f"attach to 127.0.0.1:{base + 1}" in line, line
        url = re.search(r"debug API at (http://\S+)", err.read_text())[1]
        client = DAPClient("127.0.0.1", base + 1, timeout_s=60)
        client.attach()
        stopped = client.wait_stopped(timeout_s=60)
        frames = client.stack_trace(stopped["threadId"])
        paths = [f.get("source", {}).get("path") or "" for f in frames[:3]]
        assert any(p.startswith(PACKAGE + os.sep) for p in paths), paths
        top = frames[0]["id"]
        assert client.evaluate("so.step", top) == str(BREAK_STEP)
        published = client.evaluate("__import__('devharness.debug.state', fromlist=['_'])"
                                    ".current_recorder().state", top)
        assert f"step={BREAK_STEP}" in published and "rank=1" in published, published
        # The debug API (what `devharness tui --url` reads) shows rank 1 paused at that step, rank 0 waiting.
        snap = httpx.get(f"{url}/debug/workers", timeout=10).json()
        w1 = snap["workers"][1]
        assert w1["paused"]["reason"] == "breakpoint" and w1["step"] == BREAK_STEP, w1
        w0 = snap["workers"][0]
        assert w0["paused"] is None and w0["waiting_for"] == [1] and snap["engine"]["step"] == BREAK_STEP, snap
        assert httpx.post(f"{url}/debug/engine/pause", timeout=10).status_code in (404, 405)
        client.continue_(stopped["threadId"])
        rc = proc.wait(timeout=60)
    finally:
        if client is not None:
            client.disconnect()
        if proc.poll() is None:
            if url is not None:   # a rank paused with no debugger would outlive its killed driver
                try:
                    httpx.post(f"{url}/debug/release", json={}, timeout=10)
                except httpx.HTTPError:
                    pass
            proc.kill()
            proc.wait()
    assert rc == 0, err.read_text()
    assert "replay: 5 steps, all tokens match (tp=2 pp=1 mp, kernels fast)" in out.read_text().strip().splitlines()[-1], out.read_text()

