"""The fast backend (the C kernels of kernels/cpu.py as the fast ops: decode attention, linear layers over packed
weights, greedy tokens straight from the LM head, norms, RoPE, SiLU-and-mul, KV writes; the default) gives the
greedy tokens of the reference backend (plain torch), and its numbers within tolerance, on tiny-llama and on
SmolLM2, and the model's hooks still fire in Python around its kernels. One engine per model (SmolLM2's load
takes seconds): its runner is handed the other backend's kernels between runs. Below that, a decode step's
layers on shapes the two models do not have (biases, head sizes 16 and 128, one KV head), and pipeline stages."""
import msgspec
import pytest
import torch

from devharness import LLM, SamplingParams
from devharness.kernels import REFERENCE_DECODE_ROWS, cpu, reference_kernels
from devharness.model import hooks
from tests.helpers import as_inputs, mixed_prompts

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


class _CountSites(hooks.ModelHooks):
    def __init__(self):
        self.layers_ended, self.outputs = set(), 0

    def layer_end(self, layer, hidden, residual):
        self.layers_ended.add(layer)

    def sublayer_output(self, site, output):
        self.outputs += 1


class _LastStream(hooks.ModelHooks):
    """The residual stream after the stage's last layer (its output plus the residual beside it), every forward."""

    def __init__(self, last: int):
        self.last, self.streams = last, []

    def layer_end(self, layer, hidden, residual):
        if layer == self.last:
            self.streams.append(hidden + residual)


class _CountCpu:
    """Counts calls of the C kernels (the decode attention, cpu.paged_decode or cpu.decode_attention: `calls`, with
    the most decode rows one call took: `widest`;
    cpu.packed_linear and packed_gated_linear, or with weights in GGUF's blocks cpu.q_linear: `linear_calls`;
    cpu.packed_linear_argmax, or the argmax of a q_linear product, cpu.argmax: `argmax_calls`) while installed."""

    def __init__(self, monkeypatch):
        self.calls, self.linear_calls, self.argmax_calls, self.widest = 0, 0, 0, 0

        def counted(name, attr, widest=False):
            original = getattr(cpu, name)

            def call(*args, **kw):
                setattr(self, attr, getattr(self, attr) + 1)
                if widest:
                    self.widest = max(self.widest, args[0].shape[0])   # rows (decodes) in one call
                return original(*args, **kw)
            monkeypatch.setattr(cpu, name, call)
        counted("paged_decode", "calls", widest=True)
        counted("decode_attention", "calls", widest=True)
        counted("packed_linear", "linear_calls")
        counted("packed_gated_linear", "linear_calls")
        counted("packed_linear_argmax", "argmax_calls")
        counted("q_linear", "linear_calls")
        counted("argmax", "argmax_calls")

    def reset(self):
        self.calls, self.linear_calls, self.argmax_calls, self.widest = 0, 0, 0, 0


def _use(llm, kernels):
    """Hand the engine's runner (and so its model and its sampler) `kernels`."""
    runner = llm.engine.workers.worker.runner
    runner.kernels = kernels
    runner.model.set_kernels(kernels)
    kernels.prepare(runner.model.weights_by_op())   # as load_model does: the packs made ahead


def _run(llm, prompts, params, sites=None):
    """(the completions, the last layer's stream of every forward) of `prompts` with `sites` installed."""
    runner = llm.engine.workers.worker.runner
    stream = _LastStream(runner.model._layers[-1][0])
    installed = [h for h in (stream, sites) if h is not None]
    for h in installed:
        runner.hooks.install(h)
    try:
        outs = [o.outputs[0] for o in llm.generate(as_inputs(prompts), params)]
    finally:
        for h in installed:
            runner.hooks.remove(h)
    return outs, stream.streams


def _streams_close(fast, ref, tol):
    assert len(fast) == len(ref)   # the same steps, forward for forward (the same tokens scheduled alike)
    for f, r in zip(fast, ref):
        torch.testing.assert_close(f, r, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def tiny():
    # No prefix cache, so every run computes alike.
    with LLM("tiny-llama", max_model_len=256, enable_prefix_caching=False) as llm:
        assert llm.engine.workers.worker.runner.kernels.backend == "fast"   # the default
        yield llm


@pytest.fixture(scope="module")
def smollm2():
    with LLM("smollm2", max_model_len=256, enable_prefix_caching=False) as llm:
        yield llm


@pytest.mark.timeout(300)
def test_tiny_llama_fast_matches_reference_and_hooks_fire(tiny, fast, monkeypatch):
    # Mixed prompt lengths: decode batches and table widths change from step to step. More decodes than a
    # reference decode call takes (REFERENCE_DECODE_ROWS): the fast backend takes them in one call.
    prompts = mixed_prompts(REFERENCE_DECODE_ROWS + 4, seed=3)
    count = _CountCpu(monkeypatch)
    _use(tiny, reference_kernels())
    want, want_streams = _run(tiny, prompts, PARAMS)
    assert (count.calls, count.linear_calls, count.argmax_calls) == (0, 0, 0)   # no C kernel in the reference run
    _use(tiny, fast)
    sites = _CountSites()
    got, got_streams = _run(tiny, prompts, PARAMS, sites)
    # The C kernels really ran: the decode attention, the linear layers and the greedy tokens from the LM head.
    assert count.calls > 0 and count.linear_calls > 0 and count.argmax_calls > 0
    assert count.widest > REFERENCE_DECODE_ROWS
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    _streams_close(got_streams, want_streams, 1e-4)
    assert sites.layers_ended == set(range(4)) and sites.outputs > 0   # hook sites around the kernels fired
    # The logits, through their log-probabilities (the sampler's path: the logits written, then argmax).
    with_logprobs = msgspec.structs.replace(PARAMS, logprobs=5)
    _use(tiny, reference_kernels())
    want, _ = _run(tiny, prompts, with_logprobs)
    _use(tiny, fast)
    got, _ = _run(tiny, prompts, with_logprobs)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        for lg, lw in zip(g.logprobs, w.logprobs, strict=True):
            assert lg.top_token_ids == lw.top_token_ids
            torch.testing.assert_close(torch.tensor(lg.top_logprobs), torch.tensor(lw.top_logprobs),
                                       rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(300)
def test_smollm2_fast_matches_reference(smollm2, fast, monkeypatch):
    prompts = mixed_prompts(3, seed=5, lengths=(5, 17, 40))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    count = _CountCpu(monkeypatch)
    try:
        _use(smollm2, reference_kernels())
        want, want_streams = _run(smollm2, prompts, params)
        assert (count.calls, count.linear_calls, count.argmax_calls) == (0, 0, 0)
    finally:
        _use(smollm2, fast)
    got, got_streams = _run(smollm2, prompts, params)
    assert count.calls > 0 and count.linear_calls > 0 and count.argmax_calls > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # 30 layers, and a stream with entries in the thousands: within 1e-3 (relative and absolute).
    _streams_close(got_streams, want_streams, 1e-3)


@pytest.mark.parametrize("value", [True, "yes", "eager", "native", None])
def test_kernels_must_be_one_of_the_backends(value):
    from devharness.config import ModelConfig
    with pytest.raises(ValueError, match="ModelConfig.kernels=.*must be one of reference, fast"):
        LLM("tiny-llama", kernels=value)
    with pytest.raises(ValueError, match="ModelConfig.kernels"):
        ModelConfig(kernels=value)


# -- A decode step's layers, fast against reference, on shapes the engines above do not have. --

BLOCK = 16
NUM_BLOCKS = 64


def _arches():
    from devharness.model.arch import ModelArch
    llama = ModelArch(vocab_size=300, hidden_size=192, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5)
    return {
        "grouped heads, head size 64": llama,
        "q/k/v and o biases, head size 16": ModelArch(vocab_size=300, hidden_size=128, intermediate_size=64,
                                                      num_hidden_layers=2, num_attention_heads=8,
                                                      num_key_value_heads=4, head_dim=16, qkv_bias=True,
                                                      o_proj_bias=True),
        "one KV head, head size 128": ModelArch(vocab_size=300, hidden_size=256, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                                head_dim=128),
        "an MLP width no panel divides, MLP biases": ModelArch(vocab_size=300, hidden_size=64, intermediate_size=36,
                                                              num_hidden_layers=2, num_attention_heads=4,
                                                              num_key_value_heads=2, head_dim=16, mlp_bias=True),
    }


ARCHES = _arches()


def _model(arch, pp_rank: int = 0, pp_size: int = 1, seed: int = 0):
    from devharness.model.decoder import DecoderForCausalLM
    torch.manual_seed(seed)
    model = DecoderForCausalLM(arch, pp_rank, pp_size, max_positions=512).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape) if "norm" in name else torch.randn(p.shape) / p.shape[-1] ** 0.5)
        for layer in model.model.layers.values():
            attn = layer.self_attn.attn
            attn.k_cache = torch.randn(NUM_BLOCKS, BLOCK, arch.num_key_value_heads, arch.head_dim)
            attn.v_cache = torch.randn(NUM_BLOCKS, BLOCK, arch.num_key_value_heads, arch.head_dim)
    return model


def _decode_step(lens: list[int], seed: int = 1):
    """Positions and metadata of one decode row per context length (each row's own blocks)."""
    from devharness.model.attention import AttentionMetadata, DecodeGroup
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    width = max(-(-n // BLOCK) for n in lens) + 1   # a padding column past the longest row
    tables, slots = [], []
    for n in lens:
        own = [blocks.pop() for _ in range(-(-n // BLOCK))]
        tables.append(own + [0] * (width - len(own)))
        slots.append(own[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK)
    meta = AttentionMetadata(torch.tensor(slots), len(lens), [DecodeGroup(0, torch.tensor(tables),
                                                                          torch.tensor(lens))], [])
    return torch.tensor([n - 1 for n in lens]), meta


def _caches(model):
    return [t.clone() for layer in model.model.layers.values() for t in (layer.self_attn.attn.k_cache,
                                                                         layer.self_attn.attn.v_cache)]


def _restore(model, caches):
    for i, layer in enumerate(model.model.layers.values()):
        layer.self_attn.attn.k_cache.copy_(caches[2 * i])
        layer.self_attn.attn.v_cache.copy_(caches[2 * i + 1])


def _both_backends(fast, model, *args, **kwargs):
    """The forward with the `fast` kernels and with the reference ones, from the same caches: (outputs, caches)
    of each, and the caches before."""
    before = _caches(model)
    with torch.inference_mode():
        model.set_kernels(fast)
        got = model(*args, **kwargs)
        got_caches = _caches(model)
        _restore(model, before)
        model.set_kernels(reference_kernels())
        want = model(*args, **kwargs)
    return (got, got_caches), (want, _caches(model)), before


def _close(a, b):
    if isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            _close(x, y)
    else:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", list(ARCHES))
@pytest.mark.parametrize("lens", [[1], [5, 16, 17, 40, 90, 200, 33, 2, 64, 129, 15, 31, 48]])
def test_a_decode_steps_layers_fast_match_reference(shape, lens, fast):
    arch = ARCHES[shape]
    model = _model(arch)
    positions, meta = _decode_step(lens)
    ids = torch.randint(0, arch.vocab_size, (len(lens),), generator=torch.Generator().manual_seed(2))
    (got, got_caches), (want, want_caches), before = _both_backends(fast, model, ids, positions, meta)
    _close(got, want)
    for a, b in zip(got_caches, want_caches, strict=True):
        _close(a, b)
    # The step's keys and values went in: the caches are not the ones the model started with.
    assert not torch.equal(got_caches[0], before[0])


def test_the_other_vector_width_decode_step_matches_reference(other_vector_width, fast):
    model = _model(ARCHES["grouped heads, head size 64"])
    positions, meta = _decode_step([1, 17, 40, 90])
    (got, got_caches), (want, want_caches), _ = _both_backends(fast, model, torch.tensor([1, 2, 3, 4]), positions,
                                                               meta)
    _close(got, want)
    for a, b in zip(got_caches, want_caches, strict=True):
        _close(a, b)


def test_pipeline_stages_take_hidden_and_residual_in_and_hand_them_on(fast):
    arch = ARCHES["grouped heads, head size 64"]
    lens = [3, 20, 77]
    positions, meta = _decode_step(lens)
    hidden, residual = torch.randn(3, arch.hidden_size), torch.randn(3, arch.hidden_size)
    given = hidden.clone(), residual.clone()
    middle = _model(arch, pp_rank=1, pp_size=3)
    (got, _), (want, _), _ = _both_backends(fast, middle, None, positions, meta, hidden=hidden, residual=residual)
    assert not middle.last and isinstance(got, tuple) and len(got) == 2
    _close(got, want)
    assert torch.equal(hidden, given[0]) and torch.equal(residual, given[1])   # its inputs are not written
    first = _model(arch, pp_rank=0, pp_size=3)
    (got, _), (want, _), _ = _both_backends(fast, first, torch.tensor([5, 6, 7]), positions, meta)
    _close(got, want)
    last = _model(arch, pp_rank=1, pp_size=2)   # layers 2.., then the final norm
    (got, _), (want, _), _ = _both_backends(fast, last, None, positions, meta, hidden=hidden, residual=residual)
    assert last.last
    _close(got, want)
    assert torch.equal(hidden, given[0]) and torch.equal(residual, given[1])


# What tests/model/test_native_layers.py (the decode step's layers in one C call, gone) checked that still holds of
# the fast ops inside a model: packs follow weights written in place, bad slots and tables are errors.

def test_a_weight_written_in_place_inside_a_model_is_packed_again(fast):
    """A weight edited in place between two forwards (a fault, a debugger's `w.mul_(2)`) reaches the next
    forward: the fast model then gives what the reference kernels give with the edited weights."""
    model = _model(ARCHES["grouped heads, head size 64"])
    model.set_kernels(fast)
    positions, meta = _decode_step([9, 40])
    ids = torch.tensor([3, 4])
    before = _caches(model)
    with torch.inference_mode():
        first = model(ids, positions, meta)
        _restore(model, before)
        layer = model._layers[1][1]
        layer.mlp.down_proj.weight.mul_(2.0)
        layer.mlp.gate_up_proj.weight.mul_(-1.0)
        edited = model(ids, positions, meta)
        _restore(model, before)
        model.set_kernels(reference_kernels())
        want = model(ids, positions, meta)
    assert not torch.allclose(first, edited, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(edited, want, rtol=1e-4, atol=1e-4)


def test_a_bad_slot_or_table_in_a_model_is_an_index_error(fast):
    from devharness.model.attention import AttentionMetadata, DecodeGroup
    model = _model(ARCHES["grouped heads, head size 64"])
    model.set_kernels(fast)
    positions, meta = _decode_step([4, 30])
    with torch.inference_mode():
        bad_slot = AttentionMetadata(torch.tensor([0, NUM_BLOCKS * BLOCK]), 2, meta.decode_groups, [])
        with pytest.raises(IndexError, match="outside the cache"):
            model(torch.tensor([1, 2]), positions, bad_slot)
        group = meta.decode_groups[0]
        bad_table = AttentionMetadata(meta.slot_mapping, 2, [DecodeGroup(0, group.block_tables[:, :1],
                                                                         group.context_lens)], [])
        with pytest.raises(IndexError, match="does not hold"):
            model(torch.tensor([1, 2]), positions, bad_table)


def test_a_bad_slot_or_table_in_a_replayed_step_is_the_same_index_error(fast, monkeypatch):
    """After a step of decodes was captured and replayed (step_graphs.py), a step with a slot outside the cache
    stops its replay at the kernel's error code and runs as Python, which raises the error; one whose table does not
    cover a context runs as Python; a good step then replays again, with the Python's bits."""
    from devharness.kernels import graph
    from devharness.model.attention import AttentionMetadata, DecodeGroup
    from devharness.model.step_graphs import CAPTURE_AFTER, StepGraphs
    replays = []
    real_replay = graph.Recording.replay
    monkeypatch.setattr(graph.Recording, "replay", lambda rec: replays.append(real_replay(rec)) or replays[-1])
    model = _model(ARCHES["grouped heads, head size 64"])
    model.set_kernels(fast)
    positions, meta = _decode_step([4, 30])
    ids = torch.tensor([1, 2])
    group = meta.decode_groups[0]
    with torch.inference_mode():
        for _ in range(CAPTURE_AFTER):   # Python (the first packs the weights)
            model(ids, positions, meta)
        model(ids, positions, meta)   # captures
        replayed = model(ids, positions, meta)
        assert replays and all(replays)
        replays.clear()
        bad_slot = AttentionMetadata(torch.tensor([0, NUM_BLOCKS * BLOCK]), 2, meta.decode_groups, [])
        with pytest.raises(IndexError, match="outside the cache"):
            model(ids, positions, bad_slot)
        assert replays == [False]
        replays.clear()
        bad_table = AttentionMetadata(meta.slot_mapping, 2, [DecodeGroup(0, group.block_tables[:, :1],
                                                                         group.context_lens)], [])
        with pytest.raises(IndexError, match="does not hold"):
            model(ids, positions, bad_table)
        assert not replays
        model(ids, positions, meta)   # captures again (the failed replay dropped the shape)
        again = model(ids, positions, meta)
        assert replays and all(replays)
        monkeypatch.setattr(StepGraphs, "step", lambda *a: None)
        assert torch.equal(again, replayed) and torch.equal(model(ids, positions, meta), replayed)


def _counting_decode_attention(monkeypatch) -> list:
    calls = []
    original = cpu.decode_attention
    monkeypatch.setattr(cpu, "decode_attention", lambda *a: calls.append(a[0].shape[0]) or original(*a))
    return calls


@pytest.mark.parametrize("shape", list(ARCHES))
def test_a_step_of_decodes_runs_decode_attention_with_its_parts_bits(shape, fast, monkeypatch):
    """A step whose tokens are all decodes, in one group, runs RoPE, the cache write and the attention as one op
    (decode_attention), once per layer, with the bits (output and caches) of the parts called one by one; while
    something wraps one of the parts (a planted fault, check's op capture) the model calls the parts, so that it
    sees their calls."""
    model = _model(ARCHES[shape])
    model.set_kernels(fast)
    positions, meta = _decode_step([1, 17, 40])
    ids = torch.tensor([5, 6, 7])
    calls = _counting_decode_attention(monkeypatch)
    before = _caches(model)
    with torch.inference_mode():
        fused = model(ids, positions, meta)
        fused_caches = _caches(model)
        assert calls == [3] * len(model._layers)
        _restore(model, before)
        calls.clear()
        rotated = []
        real = fast.rotate
        fast.rotate = lambda *a: rotated.append(1) or real(*a)   # a wrapper, as a fault or a capture installs
        try:
            assert not fast.fuses("decode_attention")
            parts = model(ids, positions, meta)
        finally:
            fast.rotate = real
        assert not calls and len(rotated) == 2 * len(model._layers)
        assert fast.fuses("decode_attention")
    assert torch.equal(fused, parts)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, _caches(model), strict=True))


def test_decode_attention_runs_only_where_it_applies(fast, monkeypatch):
    """Not for a step with a prompt chunk or two decode groups, per-head q/k norms (Qwen3), or the reference
    kernels: those run the parts as before."""
    from devharness.model.arch import ModelArch
    from devharness.model.attention import AttentionMetadata, DecodeGroup
    calls = _counting_decode_attention(monkeypatch)
    model = _model(ARCHES["grouped heads, head size 64"])
    model.set_kernels(fast)
    positions, meta = _decode_step([4, 30])
    group = meta.decode_groups[0]
    two_groups = AttentionMetadata(meta.slot_mapping, 2, [
        DecodeGroup(0, group.block_tables[:1], group.context_lens[:1]),
        DecodeGroup(1, group.block_tables[1:], group.context_lens[1:])], [])
    attn = model._layers[0][1].self_attn.attn
    qk_norm = _model(ModelArch(vocab_size=300, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, qk_norm=True))
    qk_norm.set_kernels(fast)
    assert attn.fuses_rotary(meta, 2) and not attn.fuses_rotary(two_groups, 2) and not attn.fuses_rotary(meta, 3)
    with torch.inference_mode():
        model(torch.tensor([1, 2]), positions, two_groups)
        assert not calls
        model.set_kernels(reference_kernels())
        model(torch.tensor([1, 2]), positions, meta)
        assert not calls and not model.kernels.fuses("decode_attention")
        qk_norm(torch.tensor([1, 2]), positions, meta)
        assert not calls
        model.set_kernels(fast)
        model(torch.tensor([1, 2]), positions, meta)
        assert calls == [2] * len(model._layers)
