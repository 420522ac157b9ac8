"""decoder.py's layer partition: the default split of the layers among pipeline stages evens out the stages' matrix
products over a workload of as many prompt tokens as generated ones, the last stage's LM head counted, as a search
over every split finds; the engine writes it into its config and the workers load those layers."""
import itertools

import pytest

from devharness import LLM, SamplingParams
from devharness.protocol.messages import InjectFault
from devharness.model.arch import ModelArch
from devharness.model.builtin import TINY_ARCH, write_hf_checkpoint
from devharness.model.decoder import balanced_layer_partition, stage_layer_range

SMOLLM2 = ModelArch(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64)
QWEN25_05B = ModelArch(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, head_dim=64)
MISTRAL_7B = ModelArch(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128)
# Four layers and a vocabulary whose LM head weighs about seven of them.
HEAVY_HEAD = ModelArch(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def stage_costs(arch: ModelArch, partition, prompt_tokens: int = 1, generated_tokens: int = 1) -> list[int]:
    """Multiply-adds of each stage, counted from the weight shapes, for a workload of so many prompt tokens (each runs
    every layer's q, k, v, o, gate, up and down projections) and generated ones (each also the LM head, on the last
    stage)."""
    h, q, kv, i = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim, \
        arch.intermediate_size
    layer = h * q + 2 * h * kv + q * h + 2 * h * i + i * h
    costs = [n * layer * (prompt_tokens + generated_tokens) for n in partition]
    costs[-1] += arch.vocab_size * h * generated_tokens
    return costs


def every_split(num_layers: int, stages: int):
    for cuts in itertools.combinations(range(1, num_layers), stages - 1):
        bounds = (0, *cuts, num_layers)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("arch", [SMOLLM2, QWEN25_05B, MISTRAL_7B, HEAVY_HEAD, TINY_ARCH],
                         ids=["smollm2", "qwen2.5-0.5b", "mistral-7b", "heavy-head", "tiny-llama"])
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_the_default_split_makes_the_slowest_stage_as_fast_as_any_split_can(arch, pp):
    if pp > arch.num_hidden_layers:
        pytest.skip("more stages than layers")
    got = balanced_layer_partition(arch, pp)
    assert len(got) == pp and min(got) >= 1 and sum(got) == arch.num_hidden_layers
    best = min(max(stage_costs(arch, split)) for split in every_split(arch.num_hidden_layers, pp))
    assert max(stage_costs(arch, got)) == best


def test_an_lm_head_that_weighs_little_leaves_the_even_split():
    # tiny-llama's head weighs a quarter of a layer: the tests' layouts (which layer a rank holds) stay as they were.
    for pp in (1, 2, 3, 4):
        even = [end - start for start, end in (stage_layer_range(4, pp, r) for r in range(pp))]
        assert balanced_layer_partition(TINY_ARCH, pp) == even
    # SmolLM2's head weighs 8 of its layers: the default sits between the split that balances prompt steps (even)
    # and the one that balances decode steps, and is busier than neither's busiest stage over the whole workload.
    got = balanced_layer_partition(SMOLLM2, 2)
    prompts, decodes = (min(every_split(30, 2), key=lambda s: max(stage_costs(SMOLLM2, s, p, g)))
                        for p, g in ((1, 0), (0, 1)))
    assert prompts == [15, 15] and decodes == [19, 11] and prompts[0] < got[0] < decodes[0]
    assert max(stage_costs(SMOLLM2, got)) < min(max(stage_costs(SMOLLM2, prompts)), max(stage_costs(SMOLLM2, decodes)))


def test_bad_stage_counts_are_named():
    with pytest.raises(ValueError, match="pipeline_parallel_size 5 does not fit the model's 4 layers"):
        balanced_layer_partition(TINY_ARCH, 5)


def test_the_engine_runs_the_balanced_split_when_none_is_given(tmp_path):
    path = write_hf_checkpoint(tmp_path / "heavy-head", HEAVY_HEAD)
    prompts = [{"prompt_token_ids": [5 + i, 17, 300 + 7 * i, 42]} for i in range(4)]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(str(path), distributed_executor_backend="uni") as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    split = min(every_split(4, 2), key=lambda s: max(stage_costs(HEAVY_HEAD, s)))
    assert split == [3, 1]
    with LLM(str(path), pipeline_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1) as llm:
        assert llm.engine.config.parallel.pp_layer_partition == split
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == reference
        # Layer 2 is stage 0's (the even split gives it to stage 1): a fault planted there on rank 0 changes the tokens.
        assert llm.engine.workers.control(InjectFault("kv-corrupt:layer=2:rank=0")) == [True, False]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] != reference
    # A partition given is the one run: there layer 2 is stage 1's, and the same fault on rank 0 changes nothing.
    with LLM(str(path), pipeline_parallel_size=2, distributed_executor_backend="mp", threads_per_worker=1,
             pp_layer_partition=[2, 2]) as llm:
        assert llm.engine.config.parallel.pp_layer_partition == [2, 2]
        assert llm.engine.workers.control(InjectFault("kv-corrupt:layer=2:rank=0")) == [True, False]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == reference
