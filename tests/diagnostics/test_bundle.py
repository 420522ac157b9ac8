"""Bundles: a worker that raises leaves one behind (its last steps, every rank's state, history, log and
stacks, the error), and `devharness replay BUNDLE` runs those steps again up to the failing one, which
fails again as recorded — or, with the planted bug taken out, does not."""
import json

import msgspec
import pytest

from devharness import LLM, SamplingParams
from devharness.cli import main
from devharness.protocol.recording import read_recording


@pytest.fixture(scope="module")
def raised_bundle(tmp_path_factory):
    d = tmp_path_factory.mktemp("bundles")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
             num_kv_blocks=64, inject="raise:step=7:rank=1", flight_steps=4, bundle_dir=str(d)) as llm:
        with pytest.raises(Exception, match="fault injected on rank 1 at step 7"):
            llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": list(range(10, 40))}], params)
        with pytest.raises(Exception):   # the engine is done for; a second failure writes no second bundle
            llm.generate([{"prompt_token_ids": [1, 2]}], params)
        bundle = llm.stats()["bundle"]
    assert [p.name for p in d.iterdir()] == [bundle.rsplit("/", 1)[-1]]
    return d / bundle.rsplit("/", 1)[-1]


def test_a_worker_error_writes_a_bundle(raised_bundle):
    b = raised_bundle
    summary = json.loads((b / "bundle.json").read_text())
    assert summary["reason"] == "worker error" and "InjectedFault: fault injected on rank 1" in summary["error"]
    assert summary["failing_step"] == 7 and summary["steps"] == [4, 7] and summary["num_steps"] == 4
    assert summary["config"]["inject"] == "raise:step=7:rank=1" and summary["versions"]["torch"]
    # tiny-llama's weights are float: no quantized blocks; their memory summed over both ranks' halves
    assert summary["weights"]["kind"] == "float" and "blocks" not in summary["weights"]
    assert summary["weights"]["bytes"] > 2 * 64 * 64 * 4
    for rank in (0, 1):
        state = json.loads((b / f"rank{rank}" / "state.json").read_text())
        assert state["rank"] == rank and state["step"] == 7
        assert json.loads((b / f"rank{rank}" / "history.json").read_text())[-1]["step"] >= 6
        assert "Thread" in (b / f"rank{rank}" / "stacks.txt").read_text()
    assert "InjectedFault" in (b / "rank1" / "log.txt").read_text()
    # Rank 0 went on into the step's first collective and waits there for rank 1, which raised.
    assert "all_reduce" in (b / "rank0" / "stacks.txt").read_text()
    rec = read_recording(b)
    assert msgspec.to_builtins(rec.manifest.weights) == summary["weights"]
    assert rec.partial and [s.scheduler_output.step for s in rec.steps] == [4, 5, 6, 7]
    assert {r.req_id for r in rec.held} == {"0", "1"} and rec.steps[-1].error_kind == "failed"
    assert rec.steps[-1].error.startswith("WorkerError: step 7")
    # Its user's alone: it holds the run's logs and stacks.
    modes = {p.relative_to(b).as_posix(): p.stat().st_mode & 0o777 for p in [b, *b.rglob("*")]}
    assert modes.pop(".") == 0o700 and "rank1/log.txt" in modes and "fr" in modes
    assert set(modes.values()) == {0o700, 0o600}
    assert all(m == (0o700 if (b / p).is_dir() else 0o600) for p, m in modes.items()), modes


def test_replaying_the_bundle_reaches_the_failing_step(raised_bundle, capsys):
    assert main(["replay", str(raised_bundle), "--threads-per-worker", "1"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("replay: 4 steps, tokens match up to step 7, which fails again as recorded: ") and \
        "fault injected on rank 1 at step 7" in out, out
    assert main(["replay", str(raised_bundle), "--tp", "1", "--executor", "uni", "--inject", "none", "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["last_step"] == 7 and result["error"] is None and result["difference"] is None
    assert result["recorded_error_kind"] == "failed"
    assert result["verdict"].startswith("replay: step 7 failed in the recording (WorkerError: step 7")
    assert "but ran here (tp=1 pp=1 uni, kernels fast, 3 matching steps before it)" in result["verdict"]


def test_a_monitor_made_after_ray_is_gone_does_not_start_ray():
    """A forced shutdown (SIGTERM with a rank paused) stops the Ray workers; the step they were running then
    fails, and its bundle makes a WorkerMonitor. That must not start a fresh local Ray (seconds, during a
    shutdown that has 10 s): it asks Ray for the driver's node only while Ray is up. In a fresh process, so
    that no other test's Ray is running."""
    from tests.helpers import fresh_python
    code = ("import types, ray\n"
            "from devharness.config import EngineConfig, ParallelConfig\n"
            "from devharness.diagnostics.workers import WorkerMonitor\n"
            "cfg = EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2, distributed_executor_backend='ray'))\n"
            "workers = types.SimpleNamespace(uses_ray=True, node_ids=['n', 'n'])\n"
            "monitor = WorkerMonitor(types.SimpleNamespace(config=cfg, workers=workers))\n"
            "print(ray.is_initialized(), sorted(monitor.remote_ranks))\n"
            "ray.shutdown()\n")
    assert fresh_python(code) == "False []"
