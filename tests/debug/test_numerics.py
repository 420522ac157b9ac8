"""The numerics check (--numerics-check) against planted nan, inf and overflow faults: each is named where it was born
(step, the rank that planted it, its layer, site and op, the request and token position), not on the tp peers that
saw it only after the all-reduce nor on the later pipeline stage; only the request whose rows held it ends, the other
prompt's tokens are a clean run's, and the engine goes on. A clean run raises no alarm and records every site's
absmax. Engines (uni, mp tp=2, mp tp=2 x pp=2) start once each; the faults are planted on them with InjectFault."""
import json
import re
from pathlib import Path

import pytest

from devharness import LLM, SamplingParams
from devharness.cli import main
from devharness.fault_spec import LAYER_SITES
from devharness.protocol.errors import NonFiniteError
from devharness.protocol.messages import GetNumerics, InjectFault

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# A first (row 0 of its batch: admitted first, or the shorter decode), B beside it; both shorter than a KV block, so
# no prefix-cache hit carries anything from one run to the next.
PROMPTS = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5, 6, 7, 8, 9, 10]}]
ENGINE = dict(model="tiny-llama", numerics_check=True, threads_per_worker=1, num_kv_blocks=64, seed=0)
LAYOUTS = {"uni": dict(distributed_executor_backend="uni"),
           "mp-tp2": dict(tensor_parallel_size=2, distributed_executor_backend="mp"),
           "mp-tp2-pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="mp")}
OPS = {"attention.partial": "o_proj", "attention": "attention all_reduce", "mlp.partial": "down_proj",
       "mlp": "mlp all_reduce", "residual": "residual add"}
# (layout, spec, the rank it is born on, its layer, its site)
CASES = [
    ("uni", "nan:layer=1:rank=0", 0, 1, "attention.partial"),
    ("uni", "inf:layer=2:rank=0:site=residual", 0, 2, "residual"),
    ("uni", "nan:layer=3:rank=0:site=mlp", 0, 3, "mlp"),
    ("uni", "overflow:layer=0:rank=0", 0, 0, "attention.partial"),
    ("mp-tp2", "nan:layer=1:rank=1", 1, 1, "attention.partial"),
    ("mp-tp2", "inf:layer=2:rank=0:site=mlp.partial", 0, 2, "mlp.partial"),
    ("mp-tp2", "overflow:layer=3:rank=1", 1, 3, "attention.partial"),
    ("mp-tp2-pp2", "nan:layer=1:rank=1", 1, 1, "attention.partial"),          # stage 0: stage 1 sees it later
    ("mp-tp2-pp2", "inf:layer=3:rank=3:site=mlp.partial", 3, 3, "mlp.partial"),
    ("mp-tp2-pp2", "overflow:layer=2:rank=2", 2, 2, "attention.partial"),
]


@pytest.fixture(scope="module")
def engines():
    """layout -> (LLM, the clean run's tokens), each started on first use."""
    started = {}
    try:
        def get(layout):
            if layout not in started:
                llm = LLM(**ENGINE, **LAYOUTS[layout])
                started[layout] = llm, tokens(llm.generate(PROMPTS, PARAMS))
            return started[layout]
        yield get
    finally:
        for llm, _ in started.values():
            llm.shutdown()


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def born(spec, layout, rank, layer, site, tp_size=2):
    tp, pp = (0, 0) if layout == "uni" else (rank % tp_size, rank // tp_size)
    return (rf"non-finite value \((nan|inf)\) born in step \d+ on rank {rank} \(tp {tp}, pp {pp}\), at layer {layer} "
            rf"{re.escape(site)} \({OPS[site]}\), request '\d+' token position 0$")


@pytest.mark.parametrize("layout, spec, rank, layer, site", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_planted_fault_is_named_where_it_was_born(engines, layout, spec, rank, layer, site):
    llm, clean = engines(layout)
    workers = llm.engine.workers
    assert sum(workers.control(InjectFault(spec))) == 1
    try:
        with pytest.raises(NonFiniteError) as info:
            llm.generate(PROMPTS, PARAMS)
    finally:
        workers.control(InjectFault(None))
    first, second = info.value.outputs
    assert first.outputs[0].finish_reason == "error"
    assert re.fullmatch(born(spec, layout, rank, layer, site), first.outputs[0].error), first.outputs[0].error
    assert str(info.value) == first.outputs[0].error
    if spec.startswith("overflow"):   # every step from then on: every request that runs layer L
        assert second.outputs[0].finish_reason == "error" and f"on rank {rank} " in second.outputs[0].error
    else:   # only the request whose rows held it ended; the other's tokens are the clean run's
        assert second.outputs[0].finish_reason == "length" and second.outputs[0].token_ids == clean[1]
    # The fault gone, the engine serves as before, and the bundle holds each rank's last steps.
    assert tokens(llm.generate(PROMPTS, PARAMS)) == clean
    bundle = Path(llm.stats()["bundle"])
    ranks = json.loads((bundle / "numerics.json").read_text())
    mine = next(r for r in ranks if r["rank"] == rank)
    assert mine["alarms"][-1]["layer"] == layer and mine["alarms"][-1]["site"] == site
    assert any(v in ("nan", "inf") for step in mine["steps"] for v in step["absmax"].values())
    assert f"layer {layer} {site}" in mine["steps"][-1]["absmax"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_clean_run_raises_no_alarm_and_records_every_site(engines, layout):
    llm, clean = engines(layout)
    before = llm.engine.stats()["step"]   # the faults' tests may have run on this engine: their steps are older
    assert tokens(llm.generate(PROMPTS, PARAMS)) == clean
    reports = llm.engine.workers.control(GetNumerics())
    assert len(reports) == llm.config.parallel.world_size
    for report in reports:
        steps = [s for s in report.steps if s.step > before]
        assert steps and all(abs(v) < float("inf") for s in steps for v in s.absmax)
        assert not [a for a in report.alarms if a.step > before]
        stage_layers = sorted({layer for layer, _ in report.sites})
        assert report.sites == [(layer, site) for layer in stage_layers for site in LAYER_SITES]


def test_without_the_check_a_nan_goes_unnamed():
    with LLM(**{**ENGINE, "numerics_check": False}, inject="nan:layer=1:rank=0") as llm:
        outs = llm.generate(PROMPTS, PARAMS)   # the nan's request samples garbage: nothing looked
        assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
        assert llm.engine.workers.control(GetNumerics())[0].steps == []


@pytest.mark.parametrize("spec, message", [
    ("nan:layer=1:rank=0:site=logits", "unknown site 'logits' (one of attention.partial, attention, mlp.partial, "
                                       "mlp, residual)"),
    ("inf:layer=1:rank=0:site=attn", "unknown site 'attn'"),
    ("nan:layer=4:rank=0", "layer 4 does not exist (layers 0..3)"),
    ("overflow:layer=7:rank=1", "layer 7 does not exist"),
    ("nan:layer=2:rank=1", "rank 1 does not run layer 2 (its pipeline stage 0 runs layers 0..1)"),
    ("nan:rank=0", "nan needs layer="),
    ("overflow:layer=1:rank=0:step=2", "'step=2' is not one of layer=, rank="),
])
def test_a_bad_spec_is_one_line_exit_2(spec, message, capsys):
    assert main(["generate", "--prompt", "hi", "--tp", "2", "--pp", "2", "--inject", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_bad_spec_is_a_value_error():
    with pytest.raises(ValueError, match="unknown site 'x'"):
        LLM(**ENGINE, inject="nan:layer=0:rank=0:site=x")


def test_generate_exits_1_naming_it(capsys):
    assert main(["generate", "--model", "tiny-llama", "--num-kv-blocks", "64", "--prompt", "hi", "--prompt",
                 "hello there", "--max-tokens", "4", "--numerics-check", "--inject", "nan:layer=2:rank=0"]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()[-1]
    assert re.fullmatch(r"devharness: error: non-finite value \(nan\) born in step 1 on rank 0 \(tp 0, pp 0\), at "
                        r"layer 2 attention\.partial \(o_proj\), request '\d+' token position 0", err), err
    assert "'hello there' -> " in captured.out and "length]" in captured.out   # the other prompt went on


def test_off_by_default_in_debug_mode_too_and_on_when_asked():
    # Its measured cost (docs/benchmarks.md) is past the 3% of a step a debug-mode default may cost.
    from devharness.engine.args import EngineArgs
    assert EngineArgs.from_kwargs(debug=True).create_engine_config().numerics_check is False
    assert EngineArgs.from_kwargs(numerics_check=True).create_engine_config().numerics_check is True
    with pytest.raises(ValueError, match="numerics_check"):
        EngineArgs.from_kwargs(numerics_check="yes").create_engine_config()
