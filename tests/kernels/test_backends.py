"""The compiled forward (ModelConfig.compile: inductor's decode attention, model/kernels.py) and the native one
(the C kernels of model/native.py: decode attention, linear layers over packed weights, norms, RoPE,
SiLU-and-mul; the default outside debug mode) give the greedy tokens of the eager one, on tiny-llama and on
SmolLM2, and the model's hooks still fire in Python around them. One process compiles each model's shapes
once (the first compile takes tens of seconds on a small CPU; inductor's on-disk cache makes later runs
faster)."""
import pytest

from devharness import LLM, SamplingParams
from devharness.model import hooks, kernels, native
from devharness.worker.model_runner import DECODE_GROUP_SIZE
from tests.helpers import as_inputs, mixed_prompts

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


class _CountSites(hooks.ModelHooks):
    def __init__(self):
        self.layers_written, self.outputs = set(), 0

    def kv_written(self, layer, k_cache, v_cache, slots):
        self.layers_written.add(layer)

    def sublayer_output(self, site, output):
        self.outputs += 1


def _greedy_by_mode(model: str, prompts, params=PARAMS, fast_hooks=None) -> dict[str, list]:
    """One engine (one load), the same prompts eager, native and compiled (the last two with `fast_hooks`
    installed); no prefix cache, so every run computes alike. Returns mode -> greedy tokens."""
    with LLM(model, max_model_len=256, enable_prefix_caching=False) as llm:
        runner = llm.engine.workers.worker.runner
        assert runner.model.kernel_mode == "native"   # the default outside debug mode
        tokens = {}
        for mode in ("eager", "native", "compiled"):
            runner.model.kernel_mode = mode
            if mode != "eager" and fast_hooks is not None:
                hooks.install(fast_hooks)
            try:
                tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(as_inputs(prompts), params)]
            finally:
                if mode != "eager" and fast_hooks is not None:
                    hooks.remove(fast_hooks)
    return tokens


def _compiled_ran() -> bool:
    """The compiled decode attention was used and did not fall back to eager."""
    return kernels._compiled_decode is not None and kernels._compiled_decode.compiled is not None


class _CountNative:
    """Counts calls of the C kernels (native.paged_decode: `calls`; native.packed_linear and
    packed_gated_linear: `linear_calls`; the most decode rows one attention call took: `widest`) while
    installed. native.decode_layers (a decode step's layers in one call) runs both: it counts as each."""

    def __init__(self, monkeypatch):
        self.calls, self.linear_calls, self.widest = 0, 0, 0
        original, original_linear = native.paged_decode, native.packed_linear
        original_gated = native.packed_gated_linear

        def counted(*args):
            self.calls += 1
            self.widest = max(self.widest, args[0].shape[0])   # rows (decodes) in one call
            return original(*args)

        def counted_linear(*args):
            self.linear_calls += 1
            return original_linear(*args)
        def counted_gated(*args):
            self.linear_calls += 1
            return original_gated(*args)
        original_layers = native.decode_layers

        def counted_layers(*args, **kwargs):
            self.calls += 1
            self.linear_calls += 1
            self.widest = max(self.widest, args[1].shape[0])   # x [rows, hidden]
            return original_layers(*args, **kwargs)
        monkeypatch.setattr(native, "decode_layers", counted_layers)
        monkeypatch.setattr(native, "paged_decode", counted)
        monkeypatch.setattr(native, "packed_linear", counted_linear)
        monkeypatch.setattr(native, "packed_gated_linear", counted_gated)


@pytest.mark.timeout(300)
def test_tiny_llama_compiled_and_native_match_eager_and_hooks_fire(monkeypatch):
    # Mixed prompt lengths: decode batches and table widths change from step to step (the dynamic graph). More
    # decodes than an eager group holds (DECODE_GROUP_SIZE): native mode takes them in one call.
    prompts = mixed_prompts(DECODE_GROUP_SIZE + 4, seed=3)
    sites, count = _CountSites(), _CountNative(monkeypatch)
    tokens = _greedy_by_mode("tiny-llama", prompts, fast_hooks=sites)
    # Both really ran (the C kernels only in the native pass: the decode attention and the linear layers).
    assert _compiled_ran() and count.calls > 0 and count.linear_calls > 0
    assert count.widest > DECODE_GROUP_SIZE
    assert tokens["compiled"] == tokens["eager"] and tokens["native"] == tokens["eager"]
    assert sites.layers_written == set(range(4)) and sites.outputs > 0   # hook sites around the kernels fired


@pytest.mark.timeout(300)
def test_smollm2_compiled_and_native_match_eager(monkeypatch):
    prompts = mixed_prompts(3, seed=5, lengths=(5, 17, 40))
    count = _CountNative(monkeypatch)
    tokens = _greedy_by_mode("smollm2", prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert _compiled_ran() and count.calls > 0 and count.linear_calls > 0
    assert tokens["compiled"] == tokens["eager"] and tokens["native"] == tokens["eager"]


@pytest.mark.parametrize("flag", ["compile", "native_kernels"])
def test_kernel_switches_must_be_bools(flag):
    with pytest.raises(ValueError, match=f"ModelConfig.{flag}"):
        LLM("tiny-llama", **{flag: "yes"})
