"""`devharness check`: site-by-site comparison with tp=1, pp=1, on the prefill and on decode steps, names the
step, layer, site and rank where a run parts: planted bugs (--inject) are found where they were planted.

Engines start once per layout (a tp=2 x pp=2 start is most of this module's time); faults are planted on the
running engine with InjectFault, the same install the worker runs for --inject."""
import json
import re

import pytest
from safetensors.torch import load_file, save_file

from devharness import LLM
from devharness.cli import main
from devharness.protocol.messages import InjectFault
from devharness.model.builtin import write_hf_checkpoint
from devharness.monitor.check import capture_run, compare, run_check

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}
DECODE_STEPS = 2
TOL = 1e-4
CLI = ["check", "--model", "tiny-llama", "--executor", "mp", "--decode-steps", str(DECODE_STEPS),
       "--prompt", "Hello there"]


@pytest.fixture(scope="module")
def reference():
    """tp=1, pp=1 in process, with the partial sums two TP shards would produce (what a tp=2 rank computes)."""
    with LLM("tiny-llama", distributed_executor_backend="uni") as llm:
        return capture_run(llm, PROMPT, DECODE_STEPS, split=2)


def check_with_fault(llm, reference, spec, tp, pp):
    workers = llm.engine.workers
    assert sum(workers.control(InjectFault(spec))) == (spec is not None)   # planted on exactly one rank
    try:
        return compare(reference, capture_run(llm, PROMPT, DECODE_STEPS), TOL, tp, pp)
    finally:
        workers.control(InjectFault(None))


@pytest.fixture(scope="module")
def tp2_pp2():
    with LLM("tiny-llama", tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="mp") as llm:
        yield llm


@pytest.fixture(scope="module")
def pp2():
    with LLM("tiny-llama", pipeline_parallel_size=2, distributed_executor_backend="mp") as llm:
        yield llm


# Layers 0-1 run on stage 0 (ranks 0, 1 at tp=2), layers 2-3 on stage 1. Expected: (step, layer, rank).
# The fault-free case runs last on each engine: removing a planted fault leaves a matching engine.
TP2_PP2 = [("allreduce-drop:layer=1:rank=1", (0, 1, 1)),
           ("rope-offset:rank=3", (0, 2, 3)),             # every layer of rank 3: its stage's first
           ("kv-corrupt:layer=3:rank=3", (1, 3, 3)),      # the prefill attends without reading the cache
           (None, None)]
PP2 = [("rope-offset:rank=1", (0, 2, 1)),
       ("kv-corrupt:layer=3:rank=1", (1, 3, 1)),
       (None, None)]


@pytest.mark.parametrize("layout, spec, where", [("tp2_pp2", *c) for c in TP2_PP2] + [("pp2", *c) for c in PP2])
def test_names_the_step_layer_and_rank_of_a_planted_fault(layout, spec, where, reference, request):
    tp, pp = (2, 2) if layout == "tp2_pp2" else (1, 2)
    report = check_with_fault(request.getfixturevalue(layout), reference, spec, tp, pp)
    first = report.first_divergent
    if where is None:
        assert report.ok and first is None, report.verdict()
        assert len(report.sites) == (DECODE_STEPS + 1) * 4 * 3   # every step, layer and site was compared
        assert report.target_tokens == report.reference_tokens and len(report.target_tokens) == DECODE_STEPS + 1
        assert re.fullmatch(rf"check: tp={tp} pp={pp} matches tp=1 at every layer "
                            r"\(max relative diff (0e\+00|\d\.?\d*e-0[5-9]), tolerance 1e-04\)", report.verdict())
        return
    step, layer, rank = where
    assert not report.ok and first.rel_diff > TOL
    assert (first.step, first.layer, first.site, first.rank) == (step, layer, "attention output", rank), report.verdict()
    assert (first.tp_rank, first.pp_rank) == (rank % tp, rank // tp)
    # Everything before the named site matched, on every rank (decode steps included).
    assert all(d.max_rel_diff <= TOL for d in report.sites[:report.sites.index(first)])
    if tp > 1 and spec.startswith(("rope-offset", "kv-corrupt")):
        assert first.partial_rel_diff > TOL    # named by its own partial sum, not by the summed output
    verdict = (f"check: diverges at step {step}, layer {layer}, attention output, rank {rank} "
               f"(tp {rank % tp}, pp {rank // tp}): relative diff {first.rel_diff:.2g}")
    tri = report.triage
    if spec.startswith("allreduce-drop"):   # a half of a sum lost: it flips the first token, by far
        assert tri is not None and tri.step == 0, report.verdict()
    if tri is not None:    # a flipped token, weighed: no planted bug here flips a near tie
        assert tri.kind == "structural" and tri.margin > tri.bound and tri.step >= step, report.verdict()
        assert report.target_tokens[tri.step] != report.reference_tokens[tri.step]
        verdict += f"; {tri.verdict('tp=1', f'tp={tp} pp={pp}')}"
    else:
        assert report.target_tokens == report.reference_tokens
    assert report.verdict() == verdict


def test_cli_tp2_match_is_one_verdict_line(capsys):
    assert main(CLI + ["--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"check: tp=2 pp=1 matches tp=1 at every layer \(max relative diff \S+, tolerance 1e-04\)\n",
                        out), out


def test_cli_json_exit_1_names_the_planted_layer_and_rank(capsys):
    assert main(CLI + ["--tp", "2", "--inject", "kv-corrupt:layer=1:rank=1", "--json"]) == 1
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1
    got = json.loads(out)
    assert not got["ok"] and got["tolerance"] == TOL and TOL < got["rel_diff"] <= got["max_rel_diff"]
    assert {k: got[k] for k in ("step", "layer", "site", "rank", "tp_rank", "pp_rank")} == \
        {"step": 1, "layer": 1, "site": "attention output", "rank": 1, "tp_rank": 1, "pp_rank": 0}
    assert got["verdict"].startswith("check: diverges at step 1, layer 1, attention output, rank 1 (tp 1, pp 0): ")
    assert got["tokens"]["target"][0] == got["tokens"]["reference"][0]    # the prefill was right


def test_names_the_first_layer_and_site_that_differ(tmp_path):
    good = write_hf_checkpoint(tmp_path / "good")
    bad = write_hf_checkpoint(tmp_path / "bad")
    weights = load_file(str(bad / "model.safetensors"))
    weights["model.layers.2.mlp.down_proj.weight"] *= 1.05            # a 5% error in layer 2 only
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    report = run_check(str(bad), PROMPT, 1e-4, decode_steps=0, reference_model=str(good),
                       distributed_executor_backend="mp", tensor_parallel_size=2)
    assert [report.site(0, layer, "residual stream").rel_diff <= 1e-4 for layer in range(4)] == \
        [True, True, False, False]
    assert report.site(0, 2, "attention output").max_rel_diff <= 1e-4
    first = report.first_divergent
    assert (first.step, first.layer, first.site) == (0, 2, "MLP output") and not report.ok
    assert first.rank == 0 and first.partial_rel_diff > 1e-4    # both shards' down_proj is off: the first named


@pytest.mark.parametrize("args, message", [
    ([], "tp=1, pp=1"),
    (["--tp", "2", "--decode-steps", "-1"], "--decode-steps -1"),
    (["--tp", "2", "--tolerance", "0"], "--tolerance 0"),
])
def test_check_bad_usage_is_one_line_exit_2(args, message, capsys):
    assert main(["check", "--model", "tiny-llama"] + args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
