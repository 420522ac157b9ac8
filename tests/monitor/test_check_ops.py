"""`devharness check --against` and `--batch-invariance`: op by op, they name the step, layer, site and op where
two kernel backends part, or where a probe's numbers depend on the batch it runs in; planted bugs (--inject
kernel:..., batch-variant:...) are found where they were planted.

Kernels: the reference backend's run of each layout is captured once; the fast engine of each layout starts
once and the faults are planted on it with InjectFault (the install --inject runs). A block of 4 tokens makes
the planted decode bug (a row longer than 2 blocks loses its last) show at decode step 3 of a 6-token prompt."""
import json
import re

import pytest

from devharness import LLM, SamplingParams
from devharness.cli import main
from devharness.kernels import OPS
from devharness.monitor.check import batch_engine_kwargs, batch_plan, capture_ops, compare_ops, run_batch_check
from devharness.protocol.messages import InjectFault

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}
DECODE_STEPS = 4
TOL = 1e-4
BUDGET = 64   # the batch check's step budget (its chunked prompt: 1.5 budgets): short tests
LAYOUTS = {"tp1": {"distributed_executor_backend": "uni"},
           "tp2": {"distributed_executor_backend": "mp", "tensor_parallel_size": 2}}


def _capture(llm):
    cap, _, _ = capture_ops(llm, [("check", PROMPT, SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0,
                                                                    ignore_eos=True))], "check")
    return cap


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    """(tp, the reference kernels' capture, a running fast engine) of one layout."""
    kw = {**LAYOUTS[request.param], "block_size": 4, "enable_prefix_caching": False}   # each run computes it all
    with LLM("tiny-llama", kernels="reference", **kw) as ref_llm:
        # A kernel bug is the fast backend's: the reference kernels take none.
        assert sum(ref_llm.engine.workers.control(InjectFault("kernel:op=paged_decode"))) == 0
        ref = _capture(ref_llm)
    with LLM("tiny-llama", kernels="fast", **kw) as fast:
        yield kw.get("tensor_parallel_size", 1), ref, fast


def check_with(layout, spec):
    tp, ref, fast = layout
    workers = fast.engine.workers
    assert sum(workers.control(InjectFault(spec))) == (0 if spec is None else tp if "rank=" not in spec else 1)
    try:
        return compare_ops(ref, _capture(fast), TOL, tp, 1, "fast kernels", "reference kernels")
    finally:
        workers.control(InjectFault(None))


# (spec, (step, layer, site, op, rank)); the fault-free case last: removing a fault leaves a matching engine.
CASES = [("kernel:op=paged_decode", (3, 0, "attention", "paged_decode", 0)),
         ("kernel:op=rms_norm", (0, 0, "attention", "rms_norm", 0)),
         # The last rank alone (rank 1 at tp=2), and a row longer than one block (the prompt: 2 blocks at step 1).
         ("kernel:op=paged_decode:rank=LAST:blocks=1", (1, 0, "attention", "paged_decode", "LAST")),
         (None, None)]


@pytest.mark.parametrize("spec, where", CASES)
def test_kernel_check_names_the_planted_kernel_bug(layout, spec, where):
    tp = layout[0]
    if spec is not None and "LAST" in spec:
        spec, where = spec.replace("LAST", str(tp - 1)), (*where[:4], tp - 1)
    report = check_with(layout, spec)
    first = report.first_divergent
    if where is None:
        assert report.ok and first is None, report.verdict()
        # Every op the forward runs was compared, at every step.
        # (tp=1 greedy: linear_argmax; tp=2: the LM head's linear shards, then argmax over the gathered logits.)
        head = {"linear_argmax"} if tp == 1 else {"argmax"}
        # tiny-llama's weights are float: the ops on GGUF's quantized blocks (q_*) do not run; nor does
        # decode_attention, whose parts the model calls one by one while the check wraps them
        ran = {op for op in OPS if op not in ("write_kv", "silu_and_mul", "argmax", "linear_argmax",
                                              "decode_attention")
               and not op.startswith("q_")} | head
        assert set(report.max_rel_diff_per_op()) == ran
        assert {d.step for d in report.sites} == set(range(DECODE_STEPS + 1))
        assert 0 < report.max_rel_diff <= TOL   # two backends: close, not the same bits
        assert re.fullmatch(rf"check: fast kernels match reference kernels at every op \(tp={tp} pp=1, tolerance "
                            r"1e-04\); largest relative diff per op: (\w+ \S+(, |$))+", report.verdict())
        return
    step, layer, site, op, rank = where
    assert not report.ok and first.rel_diff > TOL
    assert (first.step, first.layer, first.site, first.op, first.rank) == (step, layer, site, op, rank), report.verdict()
    # Everything before the named op matched, on every rank.
    assert all(d.max_rel_diff <= TOL for d in report.sites[:report.sites.index(first)])
    assert report.verdict().startswith(f"check: diverges at step {step}, layer {layer}, {site}, op {op}, rank {rank} ")
    tri = report.triage
    if op == "paged_decode":   # a block of keys dropped: it flips a token there or soon after, by far
        assert tri is not None, report.verdict()
    if tri is not None:   # a flipped token, weighed: a dropped block or a norm short of 4 columns is no near tie
        assert tri.kind == "structural" and tri.margin > tri.bound and tri.step >= step, report.verdict()
        assert report.verdict().endswith(f"; {tri.verdict('reference kernels', 'fast kernels')}")
    else:
        assert report.target_tokens == report.reference_tokens


def test_cli_kernel_check_json_and_table(capsys):
    args = ["check", "--model", "tiny-llama", "--block-size", "4", "--kernels", "fast", "--against", "reference",
            "--decode-steps", "4", "--prompt", "Hello there, how are"]
    assert main(args + ["--inject", "kernel:op=paged_decode", "--json"]) == 1
    out = capsys.readouterr().out
    got = json.loads(out)
    assert len(out.splitlines()) == 1 and not got["ok"] and got["mode"] == "kernels"
    assert (got["op"], got["layer"], got["site"]) == ("paged_decode", 0, "attention") and got["rel_diff"] > TOL
    assert main(args + ["--table"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("check: fast kernels match reference kernels at every op")
    assert any(re.match(r"\s+4\s+3\s+MLP\s+gated_linear\s+\S+", line) for line in lines), lines[:3]


# -- batch invariance ----------------------------------------------------------------------------------

def _logprobs_alone_and_batched(kernels: str):
    """The probe's logprobs (the top 20 and its token's: the whole logits row's log-softmax) alone and in the
    batch check's batch, through LLM.generate and the sampler: no capture, no op of the check's."""
    plan = batch_plan(PROMPT["prompt_token_ids"], DECODE_STEPS, 16, 264, BUDGET)
    params = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0, ignore_eos=True, logprobs=20)
    requests = plan.requests(params)
    with LLM("tiny-llama", **batch_engine_kwargs(plan.engine, {"kernels": kernels})) as llm:
        assert llm.engine.source.arch.vocab_size == 264
        alone = llm.generate([requests[0][1]], [params])[0].outputs[0]
        batched = llm.generate([p for _, p, _ in requests], [sp for _, _, sp in requests])[0].outputs[0]
    return ([(lp.token_logprob, lp.top_logprobs, lp.top_token_ids) for lp in alone.logprobs], alone.token_ids), \
        ([(lp.token_logprob, lp.top_logprobs, lp.top_token_ids) for lp in batched.logprobs], batched.token_ids)


@pytest.mark.parametrize("kernels", ["fast", "reference"])
def test_batch_check_agrees_with_the_probe_logits_alone_and_batched(kernels):
    report = run_batch_check("tiny-llama", PROMPT, 0.0, DECODE_STEPS, kernels=kernels, max_num_batched_tokens=BUDGET)
    (alone_lp, alone_tokens), (batched_lp, batched_tokens) = _logprobs_alone_and_batched(kernels)
    assert report.about["preemptions"] >= 1 and report.about["prompt_lengths"][1] > \
        report.about["max_num_batched_tokens"]   # a preemption, and a prefill chunked beside the probe
    assert report.target_tokens == batched_tokens and report.reference_tokens == alone_tokens
    assert report.ok == (alone_lp == batched_lp), report.verdict()
    verdict = report.verdict()
    if report.ok:
        assert verdict == ("check: the probe is batch-invariant at every op (tp=1 pp=1, bit for bit); its tokens "
                           "are the same")
    else:
        assert verdict.startswith(f"check: diverges at {report.first_divergent.where}, rank 0")


def test_batch_check_names_the_planted_batch_dependence():
    report = run_batch_check("tiny-llama", PROMPT, 0.0, DECODE_STEPS, inject="batch-variant:op=rms_norm",
                             max_num_batched_tokens=BUDGET)
    first = report.first_divergent
    assert (first.step, first.layer, first.site, first.op) == (0, 0, "attention", "rms_norm"), report.verdict()
    assert first.rel_diff > 0 and not report.ok
    ops = {s["op"]: s for s in report.op_summary()}
    # The op itself, on the very same inputs, gives the probe's rows other bits beside other rows.
    assert ops["rms_norm"]["alone_parted"] > 0
    assert all(s["alone_parted"] == 0 for op, s in ops.items() if op != "rms_norm")
    # A flipped token is weighed (near-tie or structural); the same tokens: nothing to weigh.
    assert (report.triage is None) == (report.target_tokens == report.reference_tokens)


def test_cli_batch_check_tp2_exit_and_table(capsys):
    code = main(["check", "--model", "tiny-llama", "--tp", "2", "--batch-invariance", "--decode-steps", "2",
                 "--max-num-batched-tokens", str(BUDGET),
                 "--inject", "batch-variant:op=add_rms_norm", "--table"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 1
    assert re.match(r"check: diverges at step 0, layer 0, MLP, op add_rms_norm, rank \d \(tp \d, pp 0\)", lines[-1])
    rows = {line.split()[0]: line.split()[1] for line in lines[1:-1]}
    assert rows["add_rms_norm"] == "no" and rows["linear"] == "yes", lines


@pytest.mark.parametrize("args, message", [
    (["--against", "fast"], "--kernels fast --against fast"),
    (["--against", "eager"], "--against: invalid choice: 'eager'"),
    (["--against", "reference", "--inject", "kernel:op=softmax"], "kernel has no bug for op 'softmax'"),
    (["--batch-invariance", "--inject", "batch-variant:op=linear"], "batch-variant has no bug for op 'linear'"),
    (["--batch-invariance", "--tp", "3"], "tensor_parallel_size=3 does not fit tiny-llama"),
    (["--batch-invariance", "--against", "reference"], "three checks: give one"),
    (["--batch-invariance", "--tolerance", "-1"], "--tolerance -1"),
])
def test_bad_input_is_one_line_exit_2(args, message, capsys):
    assert main(["check", "--model", "tiny-llama"] + args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


# -- --batch-invariant ---------------------------------------------------------------------------------

@pytest.fixture
def linear_by_rows(tmp_path, monkeypatch):
    """A machine where `bench kernels --save` chose the linear ops' custom kernels up to 8 rows and torch's
    above (as it does for large prefills where MKL is faster): workers started now read it. They load the C
    kernels already built in the usual cache (a cache of their own would have each worker compile them again)."""
    from devharness import kernels
    from devharness.kernels import cpu
    assert cpu.library() is not None, "the C kernels did not build on this machine"
    built = cpu._cache_dir()
    monkeypatch.setenv("DEVHARNESS_CACHE", str(tmp_path))
    cpu._cache_dir().symlink_to(built, target_is_directory=True)
    kernels.save_choices({"linear": "custom<=8", "gated_linear": "custom<=8", "linear_argmax": "custom<=8"})
    assert kernels.kernels_for("fast").choices["gated_linear"] == "custom<=8"
    assert kernels.kernels_for("fast", batch_invariant=True).choices["gated_linear"] == "custom"


@pytest.mark.parametrize("tp", [1, 2])
def test_batch_invariant_mode_makes_the_probe_bit_equal(linear_by_rows, tp):
    kw = {"tensor_parallel_size": tp, "distributed_executor_backend": "uni" if tp == 1 else "mp",
          "max_num_batched_tokens": BUDGET}
    variant = run_batch_check("tiny-llama", PROMPT, 0.0, 2, **kw)
    # The probe's prefill alone (6 rows: custom) and beside a chunk (64 rows: torch's) run other kernels.
    assert not variant.ok and variant.first_divergent.op in ("linear", "gated_linear"), variant.verdict()
    invariant = run_batch_check("tiny-llama", PROMPT, 0.0, 2, batch_invariant=True, **kw)
    assert invariant.ok and invariant.max_rel_diff == 0.0, invariant.verdict()
    assert all(s["alone_parted"] == 0 for s in invariant.op_summary())
    assert invariant.about["preemptions"] >= 1


def test_batch_invariant_needs_the_fast_kernels(capsys):
    assert main(["generate", "--prompt", "x", "--kernels", "reference", "--batch-invariant"]) == 2
    err = capsys.readouterr().err.strip()
    assert "batch_invariant" in err and "kernels=reference" in err and len(err.splitlines()) == 1, err


def test_one_report_shape_for_the_three_checks():
    """The layout, kernel and batch checks' reports: one verdict form, the same JSON keys, a table each."""
    from devharness.monitor.check import CheckReport, SiteDiff
    parted = dict(step=1, layer=2, rel_diff=0.5, max_rel_diff=0.5, rank=1, tp_rank=1, pp_rank=0)
    reports = {
        "layout": CheckReport([SiteDiff(site="attention output", **parted)], [1, 2], [1, 2], TOL, 2, 1, "layout"),
        "kernels": CheckReport([SiteDiff(site="attention", op="paged_decode", **parted)], [1, 2], [1, 2], TOL, 2, 1,
                               "kernels", "fast kernels", "reference kernels"),
        "batch": CheckReport([SiteDiff(site="attention", op="paged_decode", position=7, batch_step=3,
                                       alone_diff=0.0, **parted)], [1, 2], [1, 3], 0.0, 2, 1, "batch",
                             "the probe", "the probe alone"),
    }
    keys = {mode: set(r.to_json()) - {"max_rel_diff_per_op", "ops", "about"} for mode, r in reports.items()}
    assert keys["layout"] == keys["kernels"] == keys["batch"]
    for mode, r in reports.items():
        got = r.to_json()
        assert not got["ok"] and got["mode"] == mode and (got["step"], got["layer"], got["rank"]) == (1, 2, 1)
        assert r.verdict().startswith("check: diverges at step 1, layer 2, attention") and r.table()
    assert reports["kernels"].verdict().startswith("check: diverges at step 1, layer 2, attention, op paged_decode, "
                                                   "rank 1 (tp 1, pp 0): relative diff 0.5")
    assert reports["batch"].verdict().endswith("(token position 7, batched step 3): relative diff 0.5; its tokens "
                                               "differ from step 1")
