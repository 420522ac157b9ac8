"""Step recording and replay: a recorded mixed workload (prompts of different lengths, chunked prefill,
preemption, seeded sampling) replays with every token equal, on its own layout and on another; a
difference is named by step and request; a recording that is missing, truncated or from another
model is refused with one line."""
import json
import shutil

import pytest

from devharness import LLM, SamplingParams
from devharness.cli import main
from devharness.protocol.recording import STEPS, read_recording
from devharness.engine.replay import replay

# Few KV blocks and a small token budget: long prompts prefill in chunks and requests get preempted.
ENGINE = dict(model="tiny-llama", distributed_executor_backend="uni", num_kv_blocks=24, max_num_batched_tokens=48,
              max_num_seqs=6)


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """The recorded run, its tokens, and a bundle the flight recorder wrote mid-run (at step 150)."""
    d = tmp_path_factory.mktemp("rec") / "run"
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(n)]}
               for i, n in enumerate([5, 90, 17, 60, 3, 33, 120, 8])]
    params = [SamplingParams(max_tokens=70 + 8 * i, temperature=0.8, seed=100 + i, ignore_eos=True)
              if i % 2 else SamplingParams(max_tokens=80, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    with LLM(**ENGINE, record_dir=str(d), bundle_dir=str(d.parent / "bundles")) as llm:
        engine, finals, bundle = llm.engine, {}, None
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        while engine.has_unfinished_requests():
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
            if engine.core.scheduler.step_count == 150:
                bundle = llm.runner.write_bundle()
        preemptions = llm.stats()["num_preemptions"]
    assert preemptions > 0, "the workload is meant to preempt"
    return d, [finals[i].outputs[0].token_ids for i in ids], bundle


def test_the_recording_holds_every_step(recording):
    d, *_ = recording
    rec = read_recording(d)
    assert len(rec.steps) >= 200
    assert [s.scheduler_output.step for s in rec.steps] == list(range(1, len(rec.steps) + 1))
    chunked = any(0 < n < len(r.token_ids) for s in rec.steps for r in s.scheduler_output.new_requests
                  for n in [s.scheduler_output.num_scheduled_tokens[r.req_id]])
    assert chunked, "a long prompt should prefill in chunks"
    assert rec.manifest.model["name"] and rec.manifest.versions["torch"]


def test_replay_on_its_own_layout_matches(recording):
    """Every token, and each sampled row's logits digest (max logit, logsumexp) recorded with it."""
    d, *_ = recording
    rec = read_recording(d)
    sampled = [s for s in rec.steps if s.req_ids]
    assert all(len(s.logits_digest) == len(s.req_ids) for s in sampled)
    assert all(lse >= top for s in sampled for top, lse in s.logits_digest)
    result = replay(d)
    assert result.ok and result.num_steps == len(rec.steps), result.verdict()
    assert result.max_digest_diff is not None and result.max_digest_diff < 1e-4, result.verdict()


def test_replay_on_tp2_pp2_matches(recording):
    d, *_ = recording
    result = replay(d, tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="mp",
                    threads_per_worker=1)
    assert result.ok, result.verdict()
    assert result.layout.startswith("tp=2 pp=2")


def test_a_changed_token_is_named_by_step_and_request(recording, tmp_path, capsys):
    d, *_ = recording
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    rec = read_recording(bad)
    target = next(i for i, s in enumerate(rec.steps) if i > 40 and s.req_ids)
    step = rec.steps[target]
    step.sampled_token_ids[0] = (step.sampled_token_ids[0] + 1) % 256
    _rewrite(bad, rec.steps)
    assert main(["replay", str(bad)]) == 1
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"replay: step {step.scheduler_output.step} differs: request {step.req_ids[0]} token "), out


def test_bad_recordings_are_refused_with_one_line(recording, tmp_path, capsys):
    d, *_ = recording
    assert main(["replay", str(tmp_path / "nowhere")]) == 2
    assert "no recording here" in capsys.readouterr().err
    cut = tmp_path / "cut"
    shutil.copytree(d, cut)
    data = (cut / STEPS).read_bytes()
    (cut / STEPS).write_bytes(data[:-7])
    assert main(["replay", str(cut)]) == 2
    err = capsys.readouterr().err.strip()
    assert "truncated" in err and len(err.splitlines()) == 1, err
    other = tmp_path / "other"
    shutil.copytree(d, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["model"]["arch"]["num_hidden_layers"] += 1     # as if made with another model of that name
    (other / "manifest.json").write_text(json.dumps(manifest))
    assert main(["replay", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert "architecture differs" in err and len(err.splitlines()) == 1, err


def test_a_bundle_written_mid_run_replays_from_an_empty_cache(recording):
    """The flight recorder's last 64 steps at step 150: requests running from before the window are sent
    whole at their first step in it; every token matches, on the recorded layout and on tp=2."""
    _, _, bundle = recording
    rec = read_recording(bundle)
    assert rec.partial and [s.scheduler_output.step for s in rec.steps] == list(range(87, 151))
    first = rec.steps[0].scheduler_output
    held = {r.req_id for r in rec.held}
    assert held and held & {c.req_id for c in first.cached_requests}, "requests should run across the window's start"
    result = replay(bundle)
    assert result.ok and result.num_steps == 64, result.verdict()
    result = replay(bundle, tensor_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1)
    assert result.ok and result.num_steps == 64, result.verdict()


def test_generate_records_from_a_prompts_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\nOnce upon a time\n")
    d = tmp_path / "gen"
    assert main(["generate", "--prompts-file", str(prompts), "--prompt", "Hello", "--max-tokens", "5",
                 "--record", str(d), "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [json.loads(line)["prompt"] for line in lines] == ["The capital of France is", "Once upon a time", "Hello"]
    assert main(["replay", str(d)]) == 0
    assert capsys.readouterr().out.startswith(f"replay: {len(read_recording(d).steps)} steps, all tokens match")
    assert main(["replay", str(d), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main(["generate", "--max-tokens", "5"]) == 2
    assert "--prompt or --prompts-file" in capsys.readouterr().err


def _rewrite(d, steps):
    from devharness.protocol.recording import frame
    (d / STEPS).write_bytes(b"".join(map(frame, steps)))


@pytest.fixture(scope="module")
def fast_recording(tmp_path_factory):
    """A short tp=1 run on the fast kernels, in a worker process (mp), so that a replay under debug mode runs its
    debugger listener there and not in the test's process."""
    d = tmp_path_factory.mktemp("fast") / "run"
    with LLM(model="tiny-llama", distributed_executor_backend="mp", num_kv_blocks=32, threads_per_worker=1,
             record_dir=str(d)) as llm:
        assert llm.config.model.kernels == "fast"
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12]}],
                     SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    return d


def test_a_recording_names_its_kernels(fast_recording):
    rec = read_recording(fast_recording)
    kernels = rec.manifest.kernels
    assert (kernels["backend"], kernels["dtype"], kernels["device"]) == ("fast", "float32", "cpu")
    from devharness.kernels import OPS
    assert set(kernels["ops"]) == set(OPS) and kernels["ops"]["paged_decode"] == "custom"


def test_a_fast_recording_replays_under_debug_mode_bit_for_bit(fast_recording):
    """Debug mode runs serving's kernels: every sampled row's logits digest comes out equal, not close."""
    from devharness.config import DebugConfig
    from tests.helpers import free_port_base
    result = replay(fast_recording, debug=DebugConfig(enabled=True, port_base=free_port_base(1)))
    assert result.ok and result.kernels == "fast" and not result.other_kernels, result.verdict()
    assert result.max_digest_diff == 0.0, result.verdict()
    assert result.verdict().endswith("(tp=1 pp=1 mp, kernels fast), logits digests bit-equal"), result.verdict()


def test_a_replay_on_other_kernels_says_so(fast_recording, capsys):
    assert main(["replay", str(fast_recording), "--kernels", "reference", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["kernels"], got["recorded_kernels"]) == ("reference", "fast")
    assert got["weights"] == got["recorded_weights"] == "float"   # tiny-llama's: no other format to report
    assert "kernels reference, recorded with fast" in got["verdict"], got["verdict"]
    assert got["max_digest_diff"] is not None and got["max_digest_diff"] < 1e-4, got
    assert main(["replay", str(fast_recording), "--kernels", "foo"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--kernels" in err and "foo" in err and len(err.splitlines()) == 1, err
