"""A GGUF file as shipped: a tiny Llama-architecture checkpoint (transformers' Mistral, written by the tests) stored
in Q8_0 (embedding, attention) and Q4_1 (MLP), one tensor in Q5_0, loads with its Q4_1 and Q8_0 weights kept in
their blocks (the quantized ops multiply by them) at tp=1 (uni), tp=2, pp=2 and tp=2 x pp=2 (mp), tp=2 and pp=2
(Ray), and gives the greedy tokens of the same file dequantized (--dequantize) at tp=1, its logprobs within
summation order; the Q5_0 tensor is dequantized, named in one log line; a file cut inside a tensor's blocks is an
error naming the tensor. The startup line, recordings and bundles name the weights' format and memory, as shipped
or dequantized; `check --against reference` compares the quantized ops at tp=1 and tp=2 and names a planted bug on
its rank. The file is written as llama.cpp's "llama" files are read (q/k rows unpermuted on loading), so the
blocks' rows move as the float rows do."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import pytest
import torch

from devharness import LLM, SamplingParams
from devharness.cli import main
from devharness.engine.replay import replay
from devharness.model.gguf_loader import iter_gguf_weights
from devharness.distributed.parallel_state import ParallelInfo, get_parallel_info, set_parallel_info
from devharness.model.layers import QuantizedWeight, RowParallelLinear
from devharness.protocol.messages import WeightFormat
from tests.model.families import FAMILIES, MAX_NEW_TOKENS, prompt_ids, write_checkpoint, write_gguf

pytestmark = pytest.mark.engine

Q = gguf.GGMLQuantizationType
LLAMA = next(f for f in FAMILIES if f.name == "mistral")   # LlamaForCausalLM's layers under another name


def _types(layers: int) -> dict[str, Q]:
    types = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q8_0}
    for i in range(layers):
        types.update({f"blk.{i}.attn_{p}.weight": Q.Q8_0 for p in ("q", "k", "v", "output")})
        types.update({f"blk.{i}.ffn_{p}.weight": Q.Q4_1 for p in ("gate", "up", "down")})
    types["blk.1.ffn_down.weight"] = Q.Q5_0   # a type the kernels do not read
    return types


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    hf = write_checkpoint(LLAMA, root / "hf")
    path = write_gguf(hf, root / "tiny-llama-q.gguf", "llama", _types(LLAMA.config["num_hidden_layers"]))
    return hf, path


GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
# Every Q4_1 and Q8_0 tensor of the file (Q8_0: q, k, v, o of 2 layers, the embedding and the LM head; Q4_1: gate, up,
# down of 2 layers but layer 1's down, in Q5_0).
SHIPPED = {"Q4_1": 5, "Q8_0": 10}
LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2),
           "tp2-pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2)}


def _run(checkpoint, **kw) -> tuple[list[list[int]], list[list[float]], WeightFormat]:
    """Greedy tokens of the suite's prompts, each token's logprob, and how the engine held the weights."""
    hf, path = checkpoint
    with LLM(str(path), **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids(hf)], GREEDY)
        weights = llm.engine.core.weights
    return ([o.outputs[0].token_ids for o in outs],
            [[lp.token_logprob for lp in o.outputs[0].logprobs] for o in outs], weights)


@pytest.fixture(scope="module")
def dequantized(checkpoint):
    """The file dequantized to float32 at tp=1: what every quantized run is held to."""
    return _run(checkpoint, dequantize=True)


def _same_answers(got, reference) -> None:
    tokens, logprobs, _ = got
    assert tokens == reference[0]
    # The same products up to summation order: logprobs close, not bit-equal.
    assert max(abs(a - b) for g, r in zip(logprobs, reference[1]) for a, b in zip(g, r)) < 1e-4


def test_quantized_greedy_equals_its_dequantized_self(checkpoint, dequantized, caplog):
    with caplog.at_level(logging.INFO):
        quantized = _run(checkpoint, distributed_executor_backend="uni")
    lines = [r.getMessage() for r in caplog.records]
    assert any("weights as shipped (5 Q4_1, 10 Q8_0 tensors in their blocks), 0.1 MiB" in m for m in lines), lines
    # The Q5_0 tensor, which no kernel reads: dequantized on loading, said once, and the run goes on.
    assert [m for m in lines if "Q5_0" in m] == [
        "tiny-llama-q.gguf: Q5_0 tensors are dequantized to float32 (the kernels compute with Q4_1 and Q8_0 blocks)"]
    assert quantized[2].kind == "as shipped" and quantized[2].blocks == SHIPPED
    assert dequantized[2].kind == "dequantized" and not dequantized[2].blocks
    assert dequantized[2].bytes > 3 * quantized[2].bytes   # float32 against 4.5 to 8.5 bits a weight
    _same_answers(quantized, dequantized)
    assert _run(checkpoint, kernels="reference")[0] == quantized[0]   # the quantized ops' references


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_quantized_equals_its_dequantized_self(checkpoint, dequantized, layout):
    """tp shards split the blocks by rows (whole blocks), and o_proj's and down_proj's input columns on 32-weight
    block boundaries (64 / 2 and 128 / 2 columns a rank); pp stages load their own layers' blocks."""
    got = _run(checkpoint, distributed_executor_backend="mp", **LAYOUTS[layout])
    assert got[2].kind == "as shipped" and got[2].blocks == SHIPPED   # every tensor kept in blocks, once per stage
    _same_answers(got, dequantized)


def test_dequantized_is_named_in_the_startup_line_recordings_and_bundles(checkpoint, dequantized, tmp_path, caplog):
    """--dequantize: the startup line says "dequantized" and the float32 weights' memory, no Q5_0 line (every
    quantized tensor is dequantized alike); the recording's and the bundle's manifests say so, and a replay on
    the same file (the recorded config: dequantized again) finds no other weights."""
    hf, path = checkpoint
    record, bundles = tmp_path / "record", tmp_path / "bundles"
    with caplog.at_level(logging.INFO):
        with LLM(str(path), dequantize=True, distributed_executor_backend="uni", record_dir=str(record),
                 bundle_dir=str(bundles)) as llm:
            llm.generate([{"prompt_token_ids": prompt_ids(hf)[0]}], SamplingParams(max_tokens=3, temperature=0,
                                                                                   ignore_eos=True))
            bundle = Path(llm.runner.write_bundle())
            weights = llm.engine.core.weights
    assert weights == dequantized[2] and weights.kind == "dequantized" and not weights.blocks
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"; weights dequantized, {weights.bytes / 2**20:.1f} MiB; kernels" in m for m in lines), lines
    assert not [m for m in lines if "Q5_0" in m or "as shipped" in m], lines
    for manifest in (record / "manifest.json", bundle / "manifest.json"):
        assert json.loads(manifest.read_text())["weights"] == {"kind": "dequantized", "bytes": weights.bytes}
    again = replay(record)
    assert again.ok and not again.other_weights and again.weights == "dequantized", again.verdict()


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_ray_quantized_equals_its_dequantized_self(checkpoint, dequantized, layout, ray_instance):
    """The same on Ray actors: each loads its own shard's or stage's blocks."""
    got = _run(checkpoint, distributed_executor_backend="ray", **LAYOUTS[layout])
    assert got[2].kind == "as shipped" and got[2].blocks == SHIPPED
    _same_answers(got, dequantized)


def test_a_file_cut_inside_a_tensor_names_it(checkpoint, tmp_path):
    _, path = checkpoint
    data = path.read_bytes()
    inside = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.attn_output.weight")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:inside.data_offset + inside.n_bytes // 2])   # the file ends inside its blocks
    named = (r"cut\.gguf: tensor blk\.1\.attn_output\.weight \(Q8_0, shape \[64, 64\]\) takes bytes \d+\.\.\d+ of the "
             r"file, which ends at \d+: the file is cut short")
    with pytest.raises(ValueError, match=named):
        list(iter_gguf_weights(cut, torch.float32, quantized=True))
    with pytest.raises(ValueError, match=r"tensor blk\.1\.attn_output\.weight"):   # the engine's start says so too
        LLM(str(cut))


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_blocks_split_on_block_boundaries(tp, caplog):
    """A row-parallel weight (o_proj, down_proj) splits its input columns across the tp ranks: kept in blocks where
    each rank's columns are whole 32-weight blocks (64 / 2), dequantized where they would cut one (64 / 4: 16
    columns), named in a log line; either way each rank holds exactly its columns of the dequantized weight."""
    full = torch.randn(8, 64)
    quantized = QuantizedWeight(torch.from_numpy(gguf.quants.quantize(full.numpy(), Q.Q8_0)), int(Q.Q8_0),
                                "blk.0.attn_output.weight")
    plain = quantized.dequantize()
    saved = get_parallel_info()
    try:
        for rank in range(tp):
            set_parallel_info(ParallelInfo(rank=rank, tp_rank=rank, tp_size=tp))
            layer = RowParallelLinear(64, 8)
            with caplog.at_level(logging.INFO, logger="devharness.model.layers"):
                layer.weight_loader(layer.weight, quantized)
            assert (layer.qtype is not None) == (tp == 2)
            assert torch.equal(layer.float_weight(), plain[:, rank * 64 // tp:(rank + 1) * 64 // tp])
    finally:
        set_parallel_info(saved)
    cut = [r.getMessage() for r in caplog.records if "cut its 32-weight blocks" in r.getMessage()]
    assert len(cut) == (tp if tp == 4 else 0) and all(m.startswith("blk.0.attn_output.weight: 64 input columns over "
                                                                   "4 ranks") for m in cut)


# tp -> (the planted bug, the q_ ops the forward runs: at tp=2 the LM head is a q_linear shard per rank and the
# argmax runs over the gathered logits).
KERNEL_CHECKS = {1: ("kernel:op=q_linear", 0, {"q_embedding", "q_linear", "q_gated_linear", "q_linear_argmax"}),
                 2: ("kernel:op=q_linear:rank=1", 1, {"q_embedding", "q_linear", "q_gated_linear"})}


@pytest.mark.parametrize("tp", sorted(KERNEL_CHECKS))
def test_kernel_check_compares_the_quantized_ops_and_names_a_planted_bug(checkpoint, capsys, tp):
    """`check --kernels fast --against reference`: the q_ ops' C kernels against their dequantize-then-float
    references, call by call; a q_linear that drops each weight row's last block is named where it first runs, on
    the rank it was planted on (at tp=2 the last: rank 0's shard matches)."""
    spec, rank, ops = KERNEL_CHECKS[tp]
    args = ["check", "--model", str(checkpoint[1]), "--tp", str(tp), "--kernels", "fast", "--against", "reference",
            "--decode-steps", "2", "--json"]
    assert main(args) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ok"] and ops <= set(got["max_rel_diff_per_op"]), got
    assert got["verdict"].startswith(f"check: fast kernels match reference kernels at every op (tp={tp} pp=1,"), got
    assert main(args + ["--inject", spec]) == 1
    got = json.loads(capsys.readouterr().out)
    assert not got["ok"] and (got["step"], got["layer"], got["site"], got["op"]) == (0, 0, "attention", "q_linear")
    assert got["verdict"].startswith(f"check: diverges at step 0, layer 0, attention, op q_linear, rank {rank}"), got


def test_recordings_and_bundles_name_the_weights_and_replay_says_when_they_differ(checkpoint, tmp_path, caplog):
    hf, path = checkpoint
    record, bundles = tmp_path / "record", tmp_path / "bundles"
    with LLM(str(path), record_dir=str(record), bundle_dir=str(bundles)) as llm:
        llm.generate([{"prompt_token_ids": prompt_ids(hf)[0]}], SamplingParams(max_tokens=4, temperature=0,
                                                                               ignore_eos=True))
        bundle = Path(llm.runner.write_bundle())
        shipped = llm.engine.core.weights
    assert shipped.kind == "as shipped" and shipped.blocks == SHIPPED and shipped.bytes > 0
    for manifest in (record / "manifest.json", bundle / "manifest.json"):
        assert json.loads(manifest.read_text())["weights"] == {"kind": "as shipped", "blocks": SHIPPED,
                                                               "bytes": shipped.bytes}, manifest
    assert json.loads((bundle / "bundle.json").read_text())["weights"]["blocks"] == SHIPPED
    caplog.clear()
    same = replay(record)
    assert same.ok and not same.other_weights and "weights" not in same.verdict(), same.verdict()
    # The same model stored in float32: the recording replays on it, and the replay says its weights differ.
    float_file = write_gguf(hf, tmp_path / "tiny-llama-f32.gguf", "llama")
    with caplog.at_level(logging.WARNING, logger="devharness.engine.replay"):
        other = replay(record, model=str(float_file))
    assert other.other_weights and ("weights float, recorded with as shipped (5 Q4_1, 10 Q8_0 tensors in their "
                                    "blocks)") in other.verdict(), other.verdict()
    assert [r.getMessage() for r in caplog.records if r.name == "devharness.engine.replay"] == [
        "replay: the weights are held otherwise than when recorded: float here, as shipped (5 Q4_1, 10 Q8_0 tensors "
        "in their blocks) in the recording (logits may differ, tokens too)"]


def test_steps_of_a_few_decodes_replay_their_layers_kernel_calls_with_the_pythons_bits(checkpoint, monkeypatch):
    """A step of one to three decodes runs each layer as the kernel calls its Python made at the first step of that
    many rows (step_graphs.py), with the Python's bits: the same tokens and logprobs as with every step run as
    Python. The Python runs instead wherever something looks inside a layer: an op wrapped (a planted fault, check's
    capture), a hook on a projection's output, a debugger tracing the thread, torch's profiler recording; and a weight
    edited in place is captured again, so that the replay computes with it."""
    import sys

    from devharness.kernels import graph
    from devharness.model.hooks import ModelHooks
    from devharness.model.step_graphs import StepGraphs
    hf, path = checkpoint
    replays = []
    real_replay = graph.Recording.replay
    monkeypatch.setattr(graph.Recording, "replay", lambda rec: replays.append(1) or real_replay(rec))
    real_step = StepGraphs.step
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(hf)[:3]]

    with LLM(str(path), distributed_executor_backend="uni") as llm:
        model = llm.engine.workers.worker.runner.model

        def run(graphs=True):
            monkeypatch.setattr(StepGraphs, "step", real_step if graphs else lambda *a: None)
            replays.clear()
            outs = llm.generate(prompts, GREEDY)
            return [(o.outputs[0].token_ids, [lp.token_logprob for lp in o.outputs[0].logprobs]) for o in outs]

        replayed = run()
        assert replays and {k[0] for k, shape in model.step_graphs.shapes.items() if shape is not None} <= {1, 2, 3}
        assert replayed == run(graphs=False) and not replays

        def stands_down(why):
            got = run()
            assert got == replayed and not replays, why

        real = model.kernels.q_linear
        model.kernels.q_linear = lambda *a: real(*a)   # a wrapper, as a fault or a capture installs
        try:
            stands_down("a wrapped op")
        finally:
            model.kernels.q_linear = real

        class Watch(ModelHooks):
            def partial_output(self, site, partial):
                pass
        watch = model.hooks.install(Watch())
        try:
            stands_down("a hook inside the layers")
        finally:
            model.hooks.remove(watch)
        sys.settrace(lambda *a: None)
        try:
            stands_down("a debugger tracing")
        finally:
            sys.settrace(None)
        with torch.profiler.profile():
            stands_down("torch's profiler")
        assert run() == replayed and replays

        qkv = model.model.layers["0"].self_attn.qkv_proj.weight   # Q8_0 blocks: the kernels read their repack
        qkv[:, 10].bitwise_xor_(3)   # as a user might in a debugger: a weight in each row, its version moved
        edited = run()
        assert edited != replayed and replays
        assert edited == run(graphs=False)


def test_a_breakpoint_call_in_a_layer_stops_at_every_step(checkpoint, monkeypatch):
    """A `breakpoint()` written into a layer's code runs at every step, as the Python it is in would: the capture
    that meets it is refused (said in the log), and the steps of its shape run as Python from then on."""
    import sys

    from devharness.model.decoder import GatedMLP
    hf, path = checkpoint
    stops = []
    monkeypatch.setattr(sys, "breakpointhook", lambda *a, **kw: stops.append(1))
    real = GatedMLP.forward

    def forward(self, x):
        breakpoint()   # noqa: T100 - what a user writes while debugging
        return real(self, x)
    monkeypatch.setattr(GatedMLP, "forward", forward)
    with LLM(str(path), distributed_executor_backend="uni") as llm:
        model = llm.engine.workers.worker.runner.model
        layers = len(model._layers)
        out = llm.generate([{"prompt_token_ids": prompt_ids(hf)[0]}], SamplingParams(max_tokens=12, temperature=0,
                                                                                      ignore_eos=True))
        shapes = dict(model.step_graphs.shapes)
    assert len(out[0].outputs[0].token_ids) == 12
    assert len(stops) == 12 * layers   # the prompt's step and 11 decode steps, every layer
    assert shapes and all(shape is None for shape in shapes.values())
