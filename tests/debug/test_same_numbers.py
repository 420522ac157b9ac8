"""Debug mode runs serving's kernels: `generate` and `generate` under debug mode sample the same tokens from
bit-equal logits (the (max logit, logsumexp) digest a recording keeps per sampled row), on smollm2 at tp=1
(uni: the worker in the engine's process) and on tiny-llama at tp=2 x pp=2 (mp). A run on the reference
kernels (in this process) shows the digests tell kernels apart, so the comparison would catch debug mode
running others.

Every run is a fresh Python process (a uni worker in debug mode starts debugpy in its process, and
`debugpy.listen` may run once per process: not in the test runner's)."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from devharness.protocol.recording import read_recording
from tests.helpers import as_inputs, free_port_base, mixed_prompts

SCRIPT = textwrap.dedent("""
    import json, sys
    from devharness import LLM, SamplingParams
    from devharness.config import DebugConfig

    spec = json.loads(sys.argv[1])
    kwargs = dict(spec["llm"])
    if isinstance(kwargs.get("debug"), dict):
        kwargs["debug"] = DebugConfig(**kwargs["debug"])
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True)
    with LLM(spec["model"], **kwargs) as llm:
        outs = llm.generate(spec["prompts"], params)
    with open(spec["out"], "w") as f:
        json.dump([o.outputs[0].token_ids for o in outs], f)
""")

MAX_TOKENS = 8


def record_run(directory: Path, model: str, prompts, debug: bool = False, kernels: str = "fast",
               timeout_s: float = 600.0, **llm_kwargs):
    """Generate greedily in a fresh process with a recording in `directory`; (tokens per prompt, recording)."""
    directory.mkdir(parents=True)
    llm = dict(llm_kwargs, kernels=kernels, seed=0, record_dir=str(directory / "rec"))
    if debug:
        llm["debug"] = {"enabled": True, "port_base": free_port_base(4)}
    out = directory / "tokens.json"
    spec = {"model": model, "llm": llm, "prompts": prompts, "max_tokens": MAX_TOKENS, "out": str(out)}
    # Output to files, not pipes: debugpy's adapter inherits them and may outlive the script for a moment.
    with open(directory / "stdout.txt", "w") as so, open(directory / "stderr.txt", "w") as se:
        done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(spec)], stdout=so, stderr=se,
                              stdin=subprocess.DEVNULL, timeout=timeout_s, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, (directory / "stderr.txt").read_text()[-4000:]
    return json.loads(out.read_text()), read_recording(directory / "rec")


def steps_of(rec) -> list[dict]:
    """Each step as what it ran and sampled, requests named by their prompts (not their ids)."""
    prompt_of: dict[str, tuple[int, ...]] = {}
    steps = []
    for s in rec.steps:
        so = s.scheduler_output
        for r in so.new_requests:
            prompt_of.setdefault(r.req_id, tuple(r.token_ids[:r.num_prompt_tokens]))
        assert s.error is None, s.error
        if s.req_ids:   # a step that only drops finished requests samples nothing and has no digest
            assert s.logits_digest is not None and len(s.logits_digest) == len(s.req_ids), \
                f"step {so.step}: a recording keeps a logits digest per sampled row"
        steps.append({"step": so.step,
                      "scheduled": [(prompt_of[rid], n) for rid, n in so.num_scheduled_tokens.items()],
                      "sampled": [(prompt_of[rid], tok, tuple(d))
                                  for rid, tok, d in zip(s.req_ids, s.sampled_token_ids, s.logits_digest or [])]})
    return steps


def first_difference(a: list[dict], b: list[dict]) -> str | None:
    if len(a) != len(b):
        return f"{len(a)} steps against {len(b)}"
    for x, y in zip(a, b):
        if x != y:
            return f"step {x['step']}: {x} != {y}"
    return None


def digests(steps: list[dict]) -> list[tuple]:
    return [row[2] for s in steps for row in s["sampled"]]


CASES = {
    "smollm2-tp1-uni": dict(model="smollm2", prompts=["The capital of France is",
                                                      "Once upon a time, in a land far away, there lived"],
                            llm=dict(distributed_executor_backend="uni", threads_per_worker=1)),
    "tiny-llama-tp2-pp2-mp": dict(model="tiny-llama", prompts=as_inputs(mixed_prompts(3, seed=7)),
                                  llm=dict(distributed_executor_backend="mp", tensor_parallel_size=2,
                                           pipeline_parallel_size=2, threads_per_worker=1, num_kv_blocks=64)),
}


def check_same_numbers(tmp_path: Path, case: dict, expect_backend: str = "fast"):
    model, prompts, llm = case["model"], case["prompts"], case["llm"]
    toks, rec = record_run(tmp_path / "serve", model, prompts, **llm)
    dtoks, drec = record_run(tmp_path / "debug", model, prompts, debug=True, **llm)

    # What ran: the same kernels (resolved: "fast" only where the C kernels built), debug mode on in one only.
    for r, debug in ((rec, False), (drec, True)):
        assert r.config.model.kernels == expect_backend, r.config.model.kernels
        assert r.config.debug.enabled is debug
        assert r.manifest.config.model.kernels == expect_backend
    if rec.manifest.kernels is not None:   # per op, custom or library
        assert rec.manifest.kernels == drec.manifest.kernels

    steps, dsteps = steps_of(rec), steps_of(drec)
    assert len(steps) >= MAX_TOKENS and sum(len(s["sampled"]) for s in steps) == len(prompts) * MAX_TOKENS
    assert dtoks == toks
    assert first_difference(dsteps, steps) is None, \
        f"debug mode's numbers part from serving's: {first_difference(dsteps, steps)}"


@pytest.mark.parametrize("name", CASES)
def test_debug_mode_gives_serving_tokens_and_bit_equal_logits(tmp_path, name):
    from devharness.kernels import cpu
    if cpu.library() is None:
        pytest.fail("the fast (C) kernels did not build on this machine (a C compiler is part of the set-up)")
    check_same_numbers(tmp_path, CASES[name])


def test_the_digests_tell_the_kernel_backends_apart(tmp_path):
    """What makes the comparisons above able to fail: a run on the reference kernels leaves other digests (its
    last bits differ) than one on the fast kernels. In this process: no debugger is involved."""
    from devharness import LLM, SamplingParams
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    runs = {}
    for kernels in ("fast", "reference"):
        with LLM("tiny-llama", distributed_executor_backend="uni", kernels=kernels, seed=0, num_kv_blocks=64,
                 record_dir=str(tmp_path / kernels)) as llm:
            toks = [o.outputs[0].token_ids for o in llm.generate(as_inputs(mixed_prompts(3, seed=7)), params)]
        rec = read_recording(tmp_path / kernels)
        assert rec.config.model.kernels == kernels
        runs[kernels] = (toks, digests(steps_of(rec)))
    assert runs["fast"][0] == runs["reference"][0]          # the same tokens ...
    assert len(runs["fast"][1]) == len(runs["reference"][1]) == 3 * MAX_TOKENS
    # ... from digests that differ in their last bits (here 23 of the 24 rows): the C kernels sum in another order
    # than torch's. Bit-equal digests would leave the comparisons above unable to tell the backends apart.
    differ = sum(f != r for f, r in zip(runs["fast"][1], runs["reference"][1]))
    assert differ > 0, "the fast and reference kernels gave bit-equal logits digests: the digests cannot tell " \
        "kernels apart, so debug mode's equality above shows nothing"
