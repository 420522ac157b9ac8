"""Qwen2, Qwen3 and Mistral (issue 14): tiny checkpoints written by transformers' own classes give
transformers' greedy tokens exactly on uni, tp=2 x pp=2 (mp) and tp=2 (Ray), the numerics check on (no alarm). On the same engines, a
prefix-cache hit changes nothing, `devharness check` matches at every layer (its capture hooks see every
layer of every rank), a layer breakpoint fires in its layer, and the tp=2 x pp=2 recording replays on one
worker. qwen2 and qwen3 GGUF files load with their tokenizers. An unknown model_type, a sliding window shorter
than max_model_len and a tp that does not split the heads are refused in one line.

Engines start once per family and layout (mp and Ray starts are most of this module's time)."""
import json
import re
import shutil

import pytest

from devharness import LLM, SamplingParams
from devharness.cli import main
from devharness.debug.breakpoints import InjectedFault
from devharness.engine.replay import replay
from devharness.protocol.messages import ArmFault, BreakpointSpec, GetNumerics
from devharness.monitor.check import capture_run, compare
from tests.model.families import FAMILIES, MAX_NEW_TOKENS, PROMPTS, prompt_ids, reference_greedy, \
    write_checkpoint, write_gguf

import transformers

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)
# The numerics check on: a clean run of every family raises no alarm (LLM.generate would raise NonFiniteError).
ENGINE = dict(threads_per_worker=1, num_kv_blocks=64, numerics_check=True)
CHECK_PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]}
CHECK_DECODE_STEPS = 2


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """family name -> (checkpoint directory, transformers' greedy tokens, their smallest top-two logit gap),
    each written on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            family = next(f for f in FAMILIES if f.name == name)
            path = write_checkpoint(family, tmp_path_factory.mktemp(name))
            tokens, min_gap = reference_greedy(path)
            cache[name] = path, tokens, min_gap
        return cache[name]
    return get


@pytest.fixture(scope="module", params=[f.name for f in FAMILIES])
def family(request, written):
    """(name, checkpoint directory, reference tokens, smallest gap) of each family in turn."""
    return (request.param, *written(request.param))


@pytest.fixture(scope="module")
def uni(family):
    with LLM(str(family[1]), distributed_executor_backend="uni", **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def tp2_pp2(family, tmp_path_factory):
    """The engine, and the directory it records its steps in."""
    record = tmp_path_factory.mktemp(f"{family[0]}-record")
    with LLM(str(family[1]), tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="mp",
             record_dir=str(record), **ENGINE) as llm:
        yield llm, record


def generate(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_reference_is_decisive_and_diverse(family):
    name, path, reference, min_gap = family
    assert len(list(path.glob("*.safetensors"))) > 1 and (path / "model.safetensors.index.json").exists()
    # A near tie would let a rounding difference pick the other token: the seeds are chosen so none is near.
    assert min_gap > 2e-3, f"{name}: the reference's top two logits come within {min_gap:.2g} at some step"
    assert all(len(set(toks)) >= 6 for toks in reference), reference


def test_uni_matches_transformers_and_a_prefix_hit_changes_nothing(family, uni):
    name, path, reference, _ = family
    llm = uni
    assert [llm.tokenizer.encode(p) for p in PROMPTS] == prompt_ids(path)
    assert generate(llm) == reference
    hits = llm.stats()["prefix_cache_hit_tokens"]
    assert generate(llm) == reference                   # the same prompts again: their full blocks are cached
    assert llm.stats()["prefix_cache_hit_tokens"] > hits


def test_a_breakpoint_armed_for_a_layer_fires_in_it(family, uni):
    # Layer breakpoints and planted faults arm the same layer hook; this one raises where a breakpoint waits.
    last = json.loads((family[1] / "config.json").read_text())["num_hidden_layers"] - 1
    assert uni.engine.workers.control(ArmFault(BreakpointSpec(layer=last))) == [True]
    with pytest.raises(InjectedFault, match=f"layer {last}$"):
        uni.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY)


def test_tp2_pp2_mp_matches_transformers(family, tp2_pp2):
    assert generate(tp2_pp2[0]) == family[2]


def test_check_tp2_pp2_matches_tp1_at_every_layer(family, uni, tp2_pp2):
    name, path, _, _ = family
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    reference = capture_run(uni, CHECK_PROMPT, CHECK_DECODE_STEPS, split=2)
    report = compare(reference, capture_run(tp2_pp2[0], CHECK_PROMPT, CHECK_DECODE_STEPS), 1e-4, 2, 2)
    assert report.ok, report.verdict()
    assert len(report.sites) == (CHECK_DECODE_STEPS + 1) * layers * 3     # every step, layer and site


def test_a_clean_run_raises_no_numerics_alarm(family, uni, tp2_pp2):
    for llm in (uni, tp2_pp2[0]):
        generate(llm)
        reports = llm.engine.workers.control(GetNumerics())
        assert len(reports) == llm.config.parallel.world_size
        assert all(r.steps and not r.alarms for r in reports), [r.alarms for r in reports]
        assert all(abs(v) < float("inf") for r in reports for s in r.steps for v in s.absmax)


def test_tp2_pp2_recording_replays_on_one_worker(tp2_pp2):
    result = replay(tp2_pp2[1], tensor_parallel_size=1, pipeline_parallel_size=1, distributed_executor_backend="uni")
    assert result.ok and result.num_steps == result.total_steps > 0, result.verdict()


def test_ray_tp2_matches_transformers(family, ray_instance):
    with LLM(str(family[1]), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE) as llm:
        assert generate(llm) == family[2]


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_gguf_matches_transformers(written, tmp_path, name):
    path, reference, _ = written(name)
    gguf_file = write_gguf(path, tmp_path / f"tiny-{name}.gguf", architecture=name)
    with LLM(str(gguf_file), distributed_executor_backend="uni", **ENGINE) as llm:
        arch = llm.engine.source.arch
        assert arch.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[name]
        assert (arch.qkv_bias, arch.qk_norm, arch.head_dim, arch.tie_word_embeddings) == \
            {"qwen2": (True, False, 16, True), "qwen3": (False, True, 32, False)}[name]
        assert [llm.tokenizer.encode(p) for p in PROMPTS] == prompt_ids(path)
        # Digits one by one, as Qwen2's split cuts them (llama.cpp's "qwen2" pre-tokenizer).
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
        for text in ("In 2026, 512 blocks", "x = 31415 * 2\n\n  ok?", "<|im_start|>user\nhi<|im_end|>"):
            assert llm.tokenizer.encode(text) == hf.encode(text, add_special_tokens=False)
        assert generate(llm) == reference


def edited(src, dst, **changes):
    """A copy of checkpoint `src` whose config.json has `changes`."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def refused(model, message, capsys, cli_args=(), **kwargs):
    """LLM(model, **kwargs) raises a one-line ValueError with `message`; the CLI says the same and exits 2."""
    with pytest.raises(ValueError, match=message) as info:
        LLM(str(model), **{"distributed_executor_backend": "uni", **kwargs})
    assert "\n" not in str(info.value)
    assert main(["generate", "--model", str(model), "--prompt", "x", *cli_args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err


def test_unknown_model_type_is_refused(written, tmp_path, capsys):
    d = edited(written("qwen2")[0], tmp_path / "gemma", model_type="gemma", architectures=["GemmaForCausalLM"])
    refused(d, "model_type 'gemma'", capsys)


def test_sliding_window_shorter_than_max_model_len_is_refused(written, tmp_path, capsys):
    mistral = edited(written("mistral")[0], tmp_path / "mistral", sliding_window=64)
    refused(mistral, "sliding_window=64", capsys)
    qwen2 = edited(written("qwen2")[0], tmp_path / "qwen2", use_sliding_window=True, sliding_window=128)
    refused(qwen2, "sliding_window=128", capsys)
    # Up to the window, sliding-window attention is plain causal attention: that runs.
    with LLM(str(mistral), distributed_executor_backend="uni", max_model_len=64, **ENGINE) as llm:
        assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY)[0].outputs[0].token_ids) == 24


def test_tp_that_does_not_split_the_heads_is_refused(written, capsys):
    # qwen3: 4 attention heads, 2 KV heads
    refused(written("qwen3")[0], r"tensor_parallel_size=3 .* sizes that work: \[1, 2, 4\]", capsys,
            cli_args=("--tp", "3", "--executor", "mp"), tensor_parallel_size=3, distributed_executor_backend="mp")


def test_a_family_with_biases_runs_its_decode_steps_as_python_and_says_so(written, caplog):
    """Qwen2's q/k/v biases are added by torch inside a layer, which recorded kernel calls would not replay
    (step_graphs.py): the capture of its decode steps is refused, said once per step shape in the log, and its
    steps run as Python, with transformers' tokens."""
    import logging
    path, tokens, _ = written("qwen2")
    with caplog.at_level(logging.INFO, logger="devharness.model.step_graphs"):
        with LLM(str(path), distributed_executor_backend="uni", threads_per_worker=1, num_kv_blocks=64) as llm:
            outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids(path)], GREEDY)
            shapes = llm.engine.workers.worker.runner.model.step_graphs.shapes
    assert [o.outputs[0].token_ids for o in outs] == tokens
    assert shapes and all(shape is None for shape in shapes.values()), shapes
    said = [r.getMessage() for r in caplog.records if r.name == "devharness.model.step_graphs"]
    assert len(said) == len(shapes) and all("torch computed in it (aten::add_)" in m for m in said), said
