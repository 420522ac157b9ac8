"""`devharness check`: run one prompt through a tp x pp layout and through tp=1, pp=1, compare the
residual stream after every decoder layer, and name the first layer where they part."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from devharness.messages import ArmCapture, TakeCapture


@dataclass
class LayerDiff:
    layer: int
    max_abs_diff: float
    rel_diff: float          # max |target - reference| / max |reference|


@dataclass
class CheckReport:
    layers: list[LayerDiff]
    reference_tokens: list[int]
    target_tokens: list[int]
    tolerance: float

    @property
    def first_divergent(self) -> LayerDiff | None:
        return next((d for d in self.layers if not d.rel_diff <= self.tolerance), None)

    @property
    def ok(self) -> bool:
        return self.first_divergent is None and self.reference_tokens == self.target_tokens


def capture_layers(llm, prompt, num_layers: int) -> dict[int, np.ndarray]:
    """The residual stream after each layer for `prompt`'s prefill, gathered from whichever rank ran it."""
    from devharness import SamplingParams
    workers = llm.engine.workers
    workers.control(ArmCapture())
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    layers: dict[int, np.ndarray] = {}
    for per_rank in workers.control(TakeCapture()):
        for layer, (shape, data) in per_rank.items():
            layers.setdefault(layer, np.frombuffer(data, dtype=np.float32).reshape(shape))
    missing = sorted(set(range(num_layers)) - set(layers))
    if missing:
        raise RuntimeError(f"no activations captured for layers {missing}")
    return layers


def run_check(model: str, prompt, tolerance: float, max_tokens: int = 8, reference_model: str | None = None,
              **target_kwargs) -> CheckReport:
    """`reference_model` (default: `model`) runs at tp=1, pp=1 in process; `model` with target_kwargs."""
    from devharness import LLM, SamplingParams
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    common = {k: target_kwargs.pop(k) for k in ("dtype", "seed", "max_model_len") if k in target_kwargs}
    with LLM(reference_model or model, distributed_executor_backend="uni", **common) as ref:
        n = ref.engine.source.arch.num_hidden_layers
        ref_layers = capture_layers(ref, prompt, n)
        ref_tokens = ref.generate([prompt], greedy)[0].outputs[0].token_ids
    with LLM(model, **common, **target_kwargs) as target:
        tgt_layers = capture_layers(target, prompt, n)
        tgt_tokens = target.generate([prompt], greedy)[0].outputs[0].token_ids
    diffs = []
    for i in range(n):
        a, b = ref_layers[i], tgt_layers[i]
        abs_diff = float(np.abs(a - b).max()) if a.shape == b.shape else float("inf")
        diffs.append(LayerDiff(i, abs_diff, abs_diff / max(float(np.abs(a).max()), 1e-30)))
    return CheckReport(diffs, ref_tokens, tgt_tokens, tolerance)


def check_main(args) -> int:
    from devharness.engine.args import EngineArgs
    kw = EngineArgs.from_cli_args(args).kwargs()
    model = kw.pop("model")
    if kw["tensor_parallel_size"] * kw["pipeline_parallel_size"] == 1 and kw["distributed_executor_backend"] in (None, "uni"):
        raise ValueError("check compares a layout with tp=1, pp=1: give --tp or --pp above 1 (or --executor mp|ray)")
    if kw["distributed_executor_backend"] is None:
        kw["distributed_executor_backend"] = "mp"
    tol = args.tolerance if args.tolerance is not None else (1e-4 if kw["dtype"] == "float32" else 3e-2)
    report = run_check(model, args.prompt, tol, **kw)
    print(f"{model}: tp={kw['tensor_parallel_size']} pp={kw['pipeline_parallel_size']} "
          f"({kw['distributed_executor_backend']}) against tp=1 pp=1, tolerance {tol:g} (relative)")
    print(f"{'layer':>5}  {'max |diff|':>12}  {'relative':>10}")
    for d in report.layers:
        mark = "" if d.rel_diff <= tol else "  <-- diverges"
        print(f"{d.layer:>5}  {d.max_abs_diff:>12.3e}  {d.rel_diff:>10.3e}{mark}")
    same = report.reference_tokens == report.target_tokens
    print(f"greedy tokens: {'identical' if same else 'DIFFER'} ({report.target_tokens} vs {report.reference_tokens})")
    first = report.first_divergent
    if first is not None:
        print(f"first divergent layer: {first.layer} (relative difference {first.rel_diff:.3e} > {tol:g})")
    return 0 if report.ok else 1
