"""`devharness check --prefix-cache`: a prompt with its first blocks from the prefix cache matches it computed cold,
bit for bit, on every model family at tp=1 and on tiny-llama at tp=2 and pp=2; a planted kv-bitflip is named at its layer
(and rank), a kv-stale-hit at layer 0 with a block more from the cache than planned.

A layout's engines start once (a cold one and a cached one); faults are planted on the running cached engine, the
worker's with InjectFault, the driver's with kv_faults.install, the same installs --inject runs."""
import json

import pytest

from devharness import LLM
from devharness.cli import main
from devharness.debug import kv_faults
from devharness.fault_spec import parse
from devharness.monitor.check_prefix import capture_cached, capture_cold, compare_prefix, prefix_plan, run_prefix_check
from devharness.protocol.messages import InjectFault
from tests.model.families import FAMILIES, write_checkpoint

IDS = [(5 + 7 * i) % 250 for i in range(41)]   # 2 full blocks of 16 and 9 tokens
PROMPT = {"prompt_token_ids": IDS}
DECODE_STEPS = 2
CLI = ["check", "--model", "tiny-llama", "--prefix-cache", "--decode-steps", str(DECODE_STEPS), "--json"]


def run_cli(capsys, *extra):
    rc = main([*CLI, *extra])
    return rc, json.loads(capsys.readouterr().out)


def test_clean_tiny_llama_exits_0(capsys):
    rc, out = run_cli(capsys)
    assert rc == 0, out["verdict"]
    assert out["ok"] and out["mode"] == "prefix" and out["max_rel_diff"] == 0.0
    assert out["about"]["hit_blocks"] == out["about"]["planned_hit_blocks"] == 1
    assert "bit for bit" in out["verdict"]


def test_kv_bitflip_named_at_its_layer(capsys):
    rc, out = run_cli(capsys, "--inject", "kv-bitflip:layer=2")
    assert rc == 1, out["verdict"]
    assert (out["step"], out["layer"], out["site"], out["rank"]) == (0, 2, "attention output", 0), out["verdict"]


def test_kv_stale_hit_named_with_its_phantom_hit(capsys):
    rc, out = run_cli(capsys, "--inject", "kv-stale-hit")
    assert rc == 1, out["verdict"]
    assert (out["step"], out["layer"], out["site"]) == (0, 0, "attention output"), out["verdict"]
    assert out["about"]["hit_blocks"] == 2 and out["about"]["planned_hit_blocks"] == 1
    assert "a block found that was evicted" in out["verdict"]
    # Another prompt's keys read as the probe's: its first token flips, by far more than numerics move it.
    tri = out["triage"]
    assert tri["kind"] == "structural" and tri["step"] == 0 and tri["margin"] > tri["bound"], out["verdict"]
    assert out["tokens"]["target"][0] != out["tokens"]["reference"][0] and "token flip is structural" in out["verdict"]


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_every_family_matches_bit_for_bit(family, tmp_path):
    path = write_checkpoint(next(f for f in FAMILIES if f.name == family), tmp_path / family)
    report = run_prefix_check(str(path), PROMPT, 0.0, DECODE_STEPS, distributed_executor_backend="uni")
    assert report.ok, report.verdict()
    layers = {d.layer for d in report.sites if d.layer is not None}
    assert len(layers) >= 2 and any(d.site.startswith("logits") for d in report.sites)


# Each layout: its engine arguments, and a kv-bitflip with the (layer, rank) it must be named at.
LAYOUTS = {"tp2": ({"tensor_parallel_size": 2}, "kv-bitflip:layer=1:rank=1", (1, 1)),
           "pp2": ({"pipeline_parallel_size": 2}, "kv-bitflip:layer=3:rank=1", (3, 1))}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    """A cold capture and a running cached engine on one layout (mp)."""
    kw, spec, where = LAYOUTS[request.param]
    kw = {**kw, "distributed_executor_backend": "mp"}
    plan = prefix_plan(len(IDS), DECODE_STEPS, 16, 264)
    with LLM("tiny-llama", enable_prefix_caching=False, **kw) as llm:
        cold = capture_cold(llm, IDS, DECODE_STEPS)
    with LLM("tiny-llama", num_kv_blocks=plan["num_kv_blocks"], **kw) as llm:
        yield cold, llm, plan, kw, spec, where


def test_layout_clean_then_each_fault_named(layout):
    cold, llm, plan, kw, spec, where = layout
    tp, pp = kw.get("tensor_parallel_size", 1), kw.get("pipeline_parallel_size", 1)
    workers, scheduler = llm.engine.workers, llm.engine.core.scheduler

    def check():
        cached, about = capture_cached(llm, IDS, DECODE_STEPS, plan)
        return compare_prefix(cold, cached, tp, pp, about)

    report = check()
    assert report.ok, report.verdict()

    assert sum(workers.control(InjectFault(spec))) == 1
    try:
        report = check()
    finally:
        workers.control(InjectFault(None))
    first = report.first_divergent
    assert not report.ok and (first.step, first.site, (first.layer, first.rank)) == (0, "attention output", where), \
        report.verdict()

    assert kv_faults.install(parse("kv-stale-hit"), scheduler)
    try:
        report = check()
    finally:
        kv_faults.uninstall(scheduler)
    first = report.first_divergent
    assert not report.ok and (first.layer, first.site) == (0, "attention output"), report.verdict()
    assert report.about["hit_blocks"] == 2

    report = check()   # the faults taken away: clean again
    assert report.ok, report.verdict()


@pytest.mark.parametrize("extra, words", [
    (["--tolerance", "1e-3"], "bit for bit"),
    (["--prompt", "Hi"], "--prefix-cache needs at least 33"),
    (["--batch-invariance"], "give one"),
])
def test_bad_use_is_one_line_exit_2(capsys, extra, words):
    assert main([*CLI, *extra]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("spec, words", [("kv-bitflip", "needs layer="), ("kv-stale-hit:layer=1", "'layer=1'"),
                                         ("kv-bitflip:layer=1:step=0", "out of range")])
def test_fault_specs_checked(spec, words):
    with pytest.raises(ValueError, match=words):
        parse(spec)
    assert parse("kv-bitflip:layer=1:rank=1:step=3").step == 3 and parse("kv-stale-hit").step is None
