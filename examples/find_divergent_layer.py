"""Story: "tp=2 output differs from tp=1". Find the first layer where a run parts from the reference.

Here the "bug" is planted: a copy of the model whose layer 2 MLP weights are off by 5%. `run_check`
runs one prompt through the reference at tp=1 and through the suspect at tp=2, compares the residual
stream after every layer, and names the first layer that differs. From the command line the same
check is `devharness check --model M --tp 2 --pp 2`.
"""
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

from devharness.monitor.check import run_check
from devharness.model.builtin import write_hf_checkpoint

if __name__ == "__main__":   # the mp executor starts worker processes that import this file
    root = Path(tempfile.mkdtemp())
    good, bad = write_hf_checkpoint(root / "good"), write_hf_checkpoint(root / "bad")
    weights = load_file(str(bad / "model.safetensors"))
    weights["model.layers.2.mlp.down_proj.weight"] *= 1.05
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})

    report = run_check(str(bad), "The capital of France is", tolerance=1e-4, reference_model=str(good),
                       tensor_parallel_size=2, distributed_executor_backend="mp")
    for d in report.layers:
        print(f"layer {d.layer}: relative difference {d.rel_diff:.2e}")
    print("first divergent layer:", report.first_divergent.layer if report.first_divergent else None)
    print("greedy tokens identical:", report.reference_tokens == report.target_tokens)
