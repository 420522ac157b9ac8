"""A decode step's layers in one C call (native.decode_layers, DecoderForCausalLM._decode_layers) against the
same layers run one by one (the module path, native kernels): the same hidden states, residual stream and
KV caches bit for bit, on Llama shapes with and without biases, on a first and on a later pipeline stage.
It runs only where nothing must see each layer: a hook with per-layer sites keeps the layers one by one
unless it says it need not (ModelHooks.sees_each_layer), as the worker's layer watch says while no layer
breakpoint or fault is armed; steps with prefill chunks, and layers the C kernels do not take, run one by
one too."""
import msgspec
import pytest
import torch

from devharness.debug import breakpoints
from devharness.messages import BreakpointSpec
from devharness.model import hooks, native
from devharness.model.arch import ModelArch
from devharness.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from devharness.model.decoder import DecoderForCausalLM
from tests.model.test_native import other_vector_width  # noqa: F401  (a fixture)

BLOCK = 16
NUM_BLOCKS = 64

LLAMA = ModelArch(vocab_size=300, hidden_size=192, intermediate_size=256, num_hidden_layers=3,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5)
SHAPES = {
    "grouped heads, head size 64": LLAMA,
    "q/k/v and o biases, head size 16": ModelArch(vocab_size=300, hidden_size=128, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=8,
                                                  num_key_value_heads=4, head_dim=16, qkv_bias=True,
                                                  o_proj_bias=True),
    "one KV head, head size 128": ModelArch(vocab_size=300, hidden_size=256, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                            head_dim=128),
}


@pytest.fixture(autouse=True)
def _kernels():
    if native.decode_kernel() is None:
        pytest.fail("the native kernels did not build on this machine")


def _model(arch: ModelArch, seed: int = 0, pp_rank: int = 0, pp_size: int = 1) -> DecoderForCausalLM:
    torch.manual_seed(seed)
    model = DecoderForCausalLM(arch, pp_rank, pp_size, max_positions=512).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape) if "norm" in name else torch.randn(p.shape) / p.shape[-1] ** 0.5)
        for layer in model.model.layers.values():
            attn = layer.self_attn.attn
            attn.k_cache = torch.randn(NUM_BLOCKS, BLOCK, arch.num_key_value_heads, arch.head_dim)
            attn.v_cache = torch.randn(NUM_BLOCKS, BLOCK, arch.num_key_value_heads, arch.head_dim)
    model.kernel_mode = "native"
    return model


def _decode_step(lens: list[int], seed: int = 1):
    """Positions and metadata of one decode row per context length (each row's own blocks)."""
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
    layers = list(model.model.layers.values())
    for i, layer in enumerate(layers):
        layer.self_attn.attn.k_cache.copy_(caches[2 * i])
        layer.self_attn.attn.v_cache.copy_(caches[2 * i + 1])


class _Calls:
    def __init__(self, monkeypatch):
        self.n = 0
        original = native.decode_layers

        def counted(*args, **kwargs):
            self.n += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(native, "decode_layers", counted)


def _both_ways(model, *args, **kwargs):
    """The forward with the layers in one call and one by one, from the same caches: (outputs, caches) of each."""
    before = _caches(model)
    with torch.inference_mode():
        fused = model(*args, **kwargs)
        fused_caches = _caches(model)
        _restore(model, before)
        model._layers_fuse = False
        try:
            plain = model(*args, **kwargs)
        finally:
            model._layers_fuse = True
    return (fused, fused_caches), (plain, _caches(model))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("lens", [[1], [5, 16, 17, 40, 90, 200, 33, 2, 64, 129, 15, 31, 48]])
def test_one_call_gives_the_layers_one_by_one_bit_for_bit(shape, lens, monkeypatch):
    arch = SHAPES[shape]
    model, calls = _model(arch), _Calls(monkeypatch)
    assert model._layers_fuse
    positions, meta = _decode_step(lens)
    ids = torch.randint(0, arch.vocab_size, (len(lens),))
    (fused, fused_caches), (plain, plain_caches) = _both_ways(model, ids, positions, meta)
    assert calls.n == 1   # the one call ran (and only in the first forward)
    assert torch.equal(fused, plain)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, plain_caches))
    # The step's keys and values went in: the caches are not the ones the model started with.
    assert not torch.equal(fused_caches[0], _model(arch)._layers[0][1].self_attn.attn.k_cache)


def test_pipeline_stages_take_hidden_and_residual_in_and_hand_them_on(monkeypatch):
    model, calls = _model(LLAMA, pp_rank=1, pp_size=3), _Calls(monkeypatch)   # a middle stage
    lens = [3, 20, 77]
    positions, meta = _decode_step(lens)
    hidden, residual = torch.randn(3, LLAMA.hidden_size), torch.randn(3, LLAMA.hidden_size)
    given = hidden.clone(), residual.clone()
    (fused, _), (plain, _) = _both_ways(model, None, positions, meta, hidden=hidden, residual=residual)
    assert calls.n == 1 and not model.last
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
    assert torch.equal(hidden, given[0]) and torch.equal(residual, given[1])   # its inputs are not written
    first = _model(LLAMA, pp_rank=0, pp_size=3)
    (fused, _), (plain, _) = _both_ways(first, torch.tensor([5, 6, 7]), positions, meta)
    assert calls.n == 2 and torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
    last = _model(LLAMA, pp_rank=1, pp_size=2)   # layers 2.., then the final norm
    (fused, _), (plain, _) = _both_ways(last, None, positions, meta, hidden=hidden, residual=residual)
    assert calls.n == 3 and last.last and torch.equal(fused, plain)


class _EveryLayer(hooks.ModelHooks):
    def __init__(self, sees: bool | None):
        self.started, self.sees = [], sees

    def layer_start(self, layer):
        self.started.append(layer)


class _SaysWhetherItSees(_EveryLayer):
    def sees_each_layer(self):
        return self.sees


@pytest.mark.parametrize("hook, one_call", [(_EveryLayer(None), False), (_SaysWhetherItSees(True), False),
                                            (_SaysWhetherItSees(False), True)])
def test_a_hook_that_must_see_each_layer_keeps_them_one_by_one(hook, one_call, monkeypatch):
    model, calls = _model(LLAMA), _Calls(monkeypatch)
    positions, meta = _decode_step([4, 30])
    hooks.install(hook)
    try:
        with torch.inference_mode():
            model(torch.tensor([1, 2]), positions, meta)
    finally:
        hooks.remove(hook)
    assert calls.n == (1 if one_call else 0)
    assert hook.started == ([] if one_call else [0, 1, 2])


def test_the_layer_watch_sees_each_layer_only_while_a_layer_breakpoint_or_fault_is_armed():
    watch = breakpoints.LayerWatch(recorder=None)
    assert not watch.sees_each_layer()
    try:
        breakpoints.arm(BreakpointSpec(step=3, layer=1))
        assert watch.sees_each_layer()
        breakpoints.clear()
        assert not watch.sees_each_layer()
        breakpoints.arm(BreakpointSpec(step=3))   # a step breakpoint fires at the step's start: not in the layers
        assert not watch.sees_each_layer()
        breakpoints.clear()
        breakpoints.arm_fault(BreakpointSpec(step=3, layer=2))
        assert watch.sees_each_layer()
    finally:
        breakpoints.clear()
        breakpoints.clear_faults()


def test_steps_and_layers_it_does_not_take_run_one_by_one(monkeypatch):
    calls = _Calls(monkeypatch)
    model = _model(LLAMA)
    positions, meta = _decode_step([4, 30])
    # A step with a prefill chunk: the chunk's attention is SDPA's.
    chunk_meta = AttentionMetadata(torch.cat([meta.slot_mapping, torch.tensor([200, 201, 202])]), 2,
                                   meta.decode_groups, [PrefillChunk(2, 3, 3, torch.tensor([12]))])
    with torch.inference_mode():
        model(torch.tensor([1, 2, 3, 4, 5]), torch.cat([positions, torch.arange(3)]), chunk_meta)
        assert calls.n == 0
        model.kernel_mode = "eager"   # debug mode's kernels
        model(torch.tensor([1, 2]), positions, meta)
        assert calls.n == 0
        model.kernel_mode = "native"
        model(torch.tensor([1, 2]), positions, meta)
        assert calls.n == 1
    # An MLP width the gated product's panels do not divide: no pack for it, so the layers run one by one.
    odd = _model(ModelArch(vocab_size=300, hidden_size=64, intermediate_size=36, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    (fused, _), (plain, _) = _both_ways(odd, torch.tensor([1, 2]), positions, meta)
    assert calls.n == 1 and torch.equal(fused, plain)
    # Per-head q/k norms (Qwen3) and MLP biases: never one call.
    assert DecoderForCausalLM(LLAMA)._layers_fuse
    for flags in ({"qk_norm": True}, {"mlp_bias": True}):
        assert not DecoderForCausalLM(msgspec.structs.replace(LLAMA, **flags))._layers_fuse


def test_a_weight_written_in_place_is_packed_again_for_the_one_call():
    model = _model(LLAMA)
    positions, meta = _decode_step([9, 40])
    ids = torch.tensor([3, 4])
    before = _caches(model)
    with torch.inference_mode():
        first = model(ids, positions, meta)
        _restore(model, before)
        model._layers[1][1].mlp.down_proj.weight.mul_(2.0)
        fused = model(ids, positions, meta)
        _restore(model, before)
        model._layers_fuse = False
        plain = model(ids, positions, meta)
    assert not torch.equal(first, fused) and torch.equal(fused, plain)


def test_a_bad_slot_or_table_is_an_index_error():
    model = _model(LLAMA)
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


def test_the_other_vector_width_gives_the_layers_one_by_one(other_vector_width, monkeypatch):
    model, calls = _model(LLAMA), _Calls(monkeypatch)
    positions, meta = _decode_step([1, 17, 40, 90])
    (fused, fused_caches), (plain, plain_caches) = _both_ways(model, torch.tensor([1, 2, 3, 4]), positions, meta)
    assert calls.n == 1 and torch.equal(fused, plain)
    assert all(torch.equal(a, b) for a, b in zip(fused_caches, plain_caches))


def test_the_phase_profile_adds_up_and_changes_nothing():
    model = _model(LLAMA)
    positions, meta = _decode_step([9, 40, 70])
    ids = torch.tensor([3, 4, 5])
    before = _caches(model)
    with torch.inference_mode():
        plain = model(ids, positions, meta)
        _restore(model, before)
        model.layer_phase_s = torch.zeros(len(native.DECODE_LAYER_PHASES), dtype=torch.float64)
        import time
        t0 = time.perf_counter()
        timed = model(ids, positions, meta)
        wall = time.perf_counter() - t0
    phases = model.layer_phase_s
    assert torch.equal(plain, timed)
    assert (phases > 0).all() and phases.sum().item() <= wall



def test_a_table_made_for_one_build_is_made_again_for_another(other_vector_width, monkeypatch):
    other = native._kernel
    model = _model(LLAMA)
    positions, meta = _decode_step([5, 33])
    ids = torch.tensor([1, 2])
    monkeypatch.setattr(native, "_kernel", native._build())   # this machine's own width: the table is made for it
    with torch.inference_mode():
        model(ids, positions, meta)
    monkeypatch.setattr(native, "_kernel", other)              # the other width: its packs have other panels
    monkeypatch.setattr(native, "_packs", {})
    monkeypatch.setattr(native, "_gated_packs", {})
    # (The caches are not restored here: a copy into them would move their version, and so the table's key.)
    (fused, _), (plain, _) = _both_ways(model, ids, positions, meta)
    assert torch.equal(fused, plain)


def test_a_table_of_another_shape_is_named():
    x = torch.zeros(1, 4)
    with pytest.raises(ValueError, match=r"int64 \[layers, 10\], not torch.int64 \[2, 9\]"):
        native.decode_layers(torch.zeros(2, 9, dtype=torch.int64), x, None, x, x, x, x, x, 1, 1, 2, 4, 16, 1,
                             1e-5, 1.0)
