"""`devharness check` weighs the first flipped token by its logit margin: a near-tie (a difference the check
accepts as numerics could flip it) or structural (the flip needed more).

The near-tie is planted by construction, not found by search: a tiny-llama whose tp=2 layout computes one hidden
dimension as exactly 0 where tp=1 leaves a rounding residue, and whose LM head turns that dimension into the
margin between tokens that otherwise tie."""
import json

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from devharness.cli import main
from devharness.model.builtin import write_hf_checkpoint
from devharness.monitor.check import Captured, triage

J, K = 7, 11                 # hidden dimensions: J a constant, K the residue
TIE = (60, 200, 201)         # the tokens that tie where K is 0: the first of them wins an exact tie


def near_tie_checkpoint(path):
    """Layer 0's attention is the only writer of hidden dimension K: its heads 4-7 copy heads 0-3, and o_proj's
    row K takes +u from the first four heads' columns and -u from the last four's. At tp=2 each rank holds one
    half: the partial sums are p and -p, all-reduced to exactly 0. At tp=1 one matmul sums the 128 terms in its
    own order and leaves a rounding residue (a relative 1e-8 or so, within any tolerance). Dimension J is 3 in
    every embedding and no layer writes it, so the LM head's rows 60, 200 and 201, 20 along J, give those three
    tokens the largest logits, equal but for row 200's +1e4 and row 201's -1e4 along K: tp=2 ties them (token
    60), tp=1 tips them by the residue's sign (token 200 or 201)."""
    path = write_hf_checkpoint(path)
    w = load_file(str(path / "model.safetensors"))
    for layer in range(4):
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            w[f"model.layers.{layer}.{name}.weight"][[J, K]] = 0
    w["model.embed_tokens.weight"][:, J] = 3.0
    w["model.embed_tokens.weight"][:, K] = 0.0
    attn = "model.layers.0.self_attn."
    for name in ("q_proj", "k_proj", "v_proj"):   # the second half of the heads (tp rank 1's) copies the first
        t = w[attn + name + ".weight"]
        t[t.shape[0] // 2:] = t[:t.shape[0] // 2]
    o = w[attn + "o_proj.weight"]
    o[K] = w["model.layers.1.self_attn.o_proj.weight"][0]
    o[K, 64:] = -o[K, :64]
    head = w["lm_head.weight"]
    head[list(TIE)] = 0
    head[list(TIE), J] = 20.0
    head[TIE[1], K], head[TIE[2], K] = 1e4, -1e4
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_planted_near_tie_is_called_a_near_tie(tmp_path, capsys):
    model = str(near_tie_checkpoint(tmp_path / "near-tie"))
    assert main(["check", "--model", model, "--tp", "2", "--decode-steps", "1", "--prompt", "Hello", "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    tri = got["triage"]
    assert tri is not None, f"tp=1 summed o_proj's row {K} to exactly 0 here too: no tie was tipped ({got['verdict']})"
    # Every site matched within tolerance; the first token differs: tp=1 tipped the tie, tp=2 kept it exact.
    assert got["step"] is None and got["max_rel_diff"] <= got["tolerance"], got["verdict"]
    assert got["tokens"]["target"][0] == TIE[0] and got["tokens"]["reference"][0] in TIE[1:]
    assert tri["kind"] == "near-tie" and tri["step"] == 0
    assert tri["tokens"] == {"reference": got["tokens"]["reference"][0], "target": TIE[0]}
    assert 0 < tri["margin"] <= tri["bound"] and tri["target_margin"] == 0.0   # tp=2: an exact tie
    assert tri["noise"] == 1e-4 and tri["bound"] == pytest.approx(2 * tri["max_logit_diff"])
    assert got["verdict"].endswith(f"; step 0's token flip is a near-tie: top-1/top-2 logit margin "
                                   f"{tri['margin']:.2g} (tp=1), 0 (tp=2 pp=1), within the bound {tri['bound']:.2g}")


def test_planted_allreduce_drop_is_structural(capsys):
    args = ["check", "--model", "tiny-llama", "--tp", "2", "--decode-steps", "1", "--prompt", "Hello there",
            "--inject", "allreduce-drop:layer=1:rank=1"]
    assert main(args) == 1
    line = capsys.readouterr().out.strip()
    assert line.startswith("check: diverges at step 0, layer 1, attention output, rank 1 (tp 1, pp 0): ")
    assert "; step 0's token flip is structural: top-1/top-2 logit margin " in line and " beyond the bound " in line


def _captured(tokens, logits):
    return Captured({}, tokens, logits={step: np.array(row, dtype=np.float32) for step, row in logits.items()})


@pytest.mark.parametrize("ref_row, tgt_row, kind, bound", [
    # the bound: 2 * min(max |logit diff|, noise * max |reference logit|), noise 1e-3 here
    ([10.0, 9.9995, 0.0], [9.9995, 10.0, 0.0], "near-tie", 2 * 5e-4 * 1),   # moved within numerics: 2 * 5e-4
    ([10.0, 9.0, 0.0], [9.0, 10.0, 0.0], "structural", 2 * 1e-3 * 10),      # moved 1: only 2e-2 counted
    ([10.0, 9.0, 0.0], [np.nan, 10.0, 0.0], "structural", 2 * 1e-3 * 10),   # a NaN is no near-tie
])
def test_the_rule(ref_row, tgt_row, kind, bound):
    ref, tgt = _captured([7, 0, 1], {1: ref_row}), _captured([7, 1, 0], {1: tgt_row})
    got = triage(ref, tgt, 1e-3)
    assert (got.kind, got.step, got.tokens) == (kind, 1, (0, 1))
    assert got.bound == pytest.approx(bound, rel=1e-3)   # float32 logits
    assert got.margin == pytest.approx(ref_row[0] - ref_row[1], rel=1e-3)
    assert triage(ref, _captured([7, 0, 1], {1: tgt_row}), 1e-3) is None   # the same tokens: no flip to weigh
