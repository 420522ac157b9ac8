"""`devharness check`: layer-by-layer comparison with tp=1, pp=1 finds the layer where a run parts."""
from safetensors.torch import load_file, save_file

from devharness.cli import main
from devharness.monitor.check import run_check
from devharness.model.builtin import write_hf_checkpoint


def test_tp2_pp2_matches_reference_layer_by_layer(capsys):
    assert main(["check", "--model", "tiny-llama", "--tp", "2", "--pp", "2", "--executor", "mp"]) == 0
    out = capsys.readouterr().out
    assert "greedy tokens: identical" in out and "diverges" not in out
    assert sum(line.strip()[:1].isdigit() for line in out.splitlines()) == 4   # one row per layer


def test_names_the_first_layer_that_differs(tmp_path):
    good = write_hf_checkpoint(tmp_path / "good")
    bad = write_hf_checkpoint(tmp_path / "bad")
    weights = load_file(str(bad / "model.safetensors"))
    weights["model.layers.2.mlp.down_proj.weight"] *= 1.05            # a 5% error in layer 2 only
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    report = run_check(str(bad), {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, 1e-4, reference_model=str(good),
                       distributed_executor_backend="mp", tensor_parallel_size=2)
    assert [d.rel_diff <= 1e-4 for d in report.layers] == [True, True, False, False]
    assert report.first_divergent.layer == 2 and not report.ok


def test_check_needs_a_parallel_layout(capsys):
    assert main(["check", "--model", "tiny-llama"]) == 2
    assert "tp=1, pp=1" in capsys.readouterr().err
