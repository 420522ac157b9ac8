"""Bad input raises ValueError before anything runs, and requests already in the engine carry on."""
import pytest

from devharness import LLM, SamplingParams
from tests.helpers import as_inputs, mixed_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", max_model_len=128) as llm:
        yield llm


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(stop=[""]), "stop"),
])
def test_bad_sampling_params(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, words", [
    ("", "empty"), ({"prompt_token_ids": []}, "empty"), ({"prompt_token_ids": [1] * 128}, "at most 127"),
    ("x" * 200, "at most 127"), ({"prompt_token_ids": [1, 99999]}, r"\[0, 264\)"), (3.5, "prompt must be"),
    ({"text": "hi"}, "prompt_token_ids"),
])
def test_bad_prompt_leaves_running_requests_alone(llm, prompt, words):
    good = mixed_prompts(3, seed=2)
    expected = [o.outputs[0].token_ids for o in llm.generate(as_inputs(good), GREEDY)]
    engine = llm.engine
    rids = [engine.add_request(p, GREEDY) for p in as_inputs(good)]
    engine.step()
    engine.step()
    with pytest.raises(ValueError, match=words):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, prompt], GREEDY)   # the good one must not start either
    assert engine.stats()["num_running"] == 3 and engine.stats()["num_waiting"] == 0
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o.outputs[0].token_ids
    assert [finals[r] for r in rids] == expected


def test_unknown_model_names_it():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        LLM("no-such-model")


def test_missing_directory_files(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=r"no \*.safetensors"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="gpt2"):
        LLM(str(tmp_path))


def test_tp_that_does_not_divide_heads():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .* sizes that work: \[1, 2, 4, 8\]"):
        LLM("tiny-llama", tensor_parallel_size=3, distributed_executor_backend="mp")


def test_bad_config_values():
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM("tiny-llama", distributed_executor_backend="threads")
    with pytest.raises(ValueError, match="'uni': runs one worker .* needs 'mp' or 'ray'"):
        LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="dtype"):
        LLM("tiny-llama", dtype="int3")
