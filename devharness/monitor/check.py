"""`devharness check`: run one prompt through a tp x pp layout and through tp=1, pp=1, compare every layer's
attention output, MLP output and residual stream on the prefill (step 0) and on N decode steps (1..N), and
name the first (step, layer, site) where they part and the rank to blame.

Blame: at tp > 1 each rank's partial sum (its o_proj / down_proj share before the all-reduce) is compared
with the partial sum the reference computes from the same slice of its full weights; the first rank whose
partial parts is named. Else the first rank whose copy of the site parts (a rank that skipped the
all-reduce, or the one stage that ran the layer under pp).

Decode steps: both runs decode greedily on their own. Step k (k >= 1) feeds the token sampled at step k - 1,
so it is compared only while both runs sampled the same tokens before it; tokens that part mean an earlier
site already diverged (or, within tolerance, tipped a near tie: then the verdict says so).
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass

import numpy as np

from devharness.protocol.messages import ArmCapture, TakeCapture

SITES = {"attention": "attention output", "mlp": "MLP output", "residual": "residual stream"}
_ORDER = {site: i for i, site in enumerate(SITES)}


@dataclass
class Captured:
    """One run's activations: (step, layer, site, shard or None for the full tensor) -> rank -> values."""

    tensors: dict[tuple, dict[int, np.ndarray]]
    tokens: list[int]


@dataclass
class SiteDiff:
    """One site of one step, compared on every rank that holds it; `rank` is the one to blame."""

    step: int
    layer: int
    site: str                        # a value of SITES
    rel_diff: float                  # the blamed rank's max |target - reference| / max |reference|
    max_rel_diff: float              # the largest over every rank's copy and partial sum of this site
    rank: int
    tp_rank: int
    pp_rank: int
    partial_rel_diff: float | None   # the blamed rank's partial sum, where tp > 1 and the site has one


@dataclass
class CheckReport:
    sites: list[SiteDiff]            # in order: step, layer, attention / MLP / residual
    reference_tokens: list[int]
    target_tokens: list[int]
    tolerance: float
    tp_size: int
    pp_size: int

    @property
    def first_divergent(self) -> SiteDiff | None:
        return next((d for d in self.sites if not d.max_rel_diff <= self.tolerance), None)

    @property
    def ok(self) -> bool:
        return self.first_divergent is None and self.reference_tokens == self.target_tokens

    def site(self, step: int, layer: int, site: str) -> SiteDiff:
        return next(d for d in self.sites if (d.step, d.layer, d.site) == (step, layer, site))

    @property
    def max_rel_diff(self) -> float:
        return max((d.max_rel_diff for d in self.sites), default=0.0)

    def verdict(self) -> str:
        first = self.first_divergent
        if first is not None:
            return (f"check: diverges at step {first.step}, layer {first.layer}, {first.site}, rank {first.rank} "
                    f"(tp {first.tp_rank}, pp {first.pp_rank}): relative diff {first.rel_diff:.2g}")
        if self.reference_tokens != self.target_tokens:
            step = next((i for i, (a, b) in enumerate(zip(self.target_tokens, self.reference_tokens)) if a != b),
                        min(len(self.target_tokens), len(self.reference_tokens)))
            if step >= min(len(self.target_tokens), len(self.reference_tokens)):
                return f"check: tp=1 sampled {len(self.reference_tokens)} tokens, the target {len(self.target_tokens)}"
            return (f"check: every site matches within tolerance {self.tolerance:.0e}, but step {step} sampled token "
                    f"{self.target_tokens[step]} where tp=1 sampled {self.reference_tokens[step]}")
        return (f"check: tp={self.tp_size} pp={self.pp_size} matches tp=1 at every layer "
                f"(max relative diff {self.max_rel_diff:.0e}, tolerance {self.tolerance:.0e})")

    def to_json(self) -> dict:
        first = self.first_divergent
        fields = ("step", "layer", "site", "rank", "tp_rank", "pp_rank", "rel_diff", "partial_rel_diff")
        out = {"ok": self.ok, "verdict": self.verdict(), **{f: None for f in fields}}
        if first is not None:
            out.update({f: asdict(first)[f] for f in fields})
        out.update(max_rel_diff=self.max_rel_diff, tolerance=self.tolerance,
                   tokens={"target": self.target_tokens, "reference": self.reference_tokens})
        return out


def capture_run(llm, prompt, decode_steps: int, split: int | None = None) -> Captured:
    """`prompt`'s prefill and `decode_steps` greedy decode steps on `llm`, every site of every rank captured
    (`split`: see ArmCapture)."""
    from devharness import SamplingParams
    workers = llm.engine.workers
    workers.control(ArmCapture(split))
    try:
        out = llm.generate([prompt], SamplingParams(max_tokens=decode_steps + 1, temperature=0, ignore_eos=True))
    except BaseException:
        with contextlib.suppress(Exception):
            workers.control(TakeCapture())   # disarm: an in-process worker's hooks outlive this engine
        raise
    tensors: dict[tuple, dict[int, np.ndarray]] = {}
    for rank, kept in enumerate(workers.control(TakeCapture())):
        for c in kept:
            values = np.frombuffer(c.data, dtype=np.float32).reshape(c.shape)
            tensors.setdefault((c.step, c.layer, c.site, c.shard), {})[rank] = values
    return Captured(tensors, list(out[0].outputs[0].token_ids))


def _rel_diff(ref: np.ndarray | None, tgt: np.ndarray) -> float:
    if ref is None or ref.shape != tgt.shape:
        return float("inf")
    return float(np.abs(tgt - ref).max()) / max(float(np.abs(ref).max()), 1e-30)


def compare(ref: Captured, tgt: Captured, tolerance: float, tp_size: int, pp_size: int) -> CheckReport:
    """Every site the target captured against the reference (captured with split=tp_size)."""
    # Step k >= 1 decodes the token step k - 1 sampled: comparable while the tokens before it agree.
    steps = next((k for k in range(1, len(ref.tokens)) if ref.tokens[:k] != tgt.tokens[:k]), len(ref.tokens))
    full = sorted((k for k in tgt.tensors if k[3] is None and k[0] < steps), key=lambda k: (k[0], k[1], _ORDER[k[2]]))
    if missing := sorted({k for k in ref.tensors if k[3] is None and k[0] < steps} - set(full)):
        raise RuntimeError(f"the target captured no activations for (step, layer, site) {missing[:4]}")
    sites = []
    for step, layer, site, _ in full:
        reference = ref.tensors.get((step, layer, site, None), {}).get(0)
        copies = {rank: _rel_diff(reference, t) for rank, t in sorted(tgt.tensors[(step, layer, site, None)].items())}
        partials = {}   # rank -> its partial sum against the reference's same shard (tp > 1)
        for shard in range(tp_size if tp_size > 1 else 0):
            for rank, t in tgt.tensors.get((step, layer, site, shard), {}).items():
                partials[rank] = _rel_diff(ref.tensors.get((step, layer, site, shard), {}).get(0), t)
        parted = [r for r in sorted(partials) if not partials[r] <= tolerance]
        parted = parted or [r for r in copies if not copies[r] <= tolerance] or [min(copies)]
        blame = parted[0]
        sites.append(SiteDiff(step, layer, SITES[site], copies[blame], max([*copies.values(), *partials.values()]),
                              blame, blame % tp_size, blame // tp_size, partials.get(blame)))
    return CheckReport(sites, ref.tokens, tgt.tokens, tolerance, tp_size, pp_size)


def run_check(model: str, prompt, tolerance: float, decode_steps: int = 4, reference_model: str | None = None,
              **target_kwargs) -> CheckReport:
    """`reference_model` (default: `model`) runs at tp=1, pp=1 in process; `model` with target_kwargs."""
    from devharness import LLM
    # Both on the target's device: a GPU layout is checked against the same GPU at tp=1, not against the CPU.
    common = {k: target_kwargs.pop(k) for k in ("dtype", "seed", "max_model_len", "device") if k in target_kwargs}
    tp, pp = target_kwargs.get("tensor_parallel_size", 1), target_kwargs.get("pipeline_parallel_size", 1)
    with LLM(reference_model or model, distributed_executor_backend="uni", **common) as ref_llm:
        ref = capture_run(ref_llm, prompt, decode_steps, split=tp)
    with LLM(model, **common, **target_kwargs) as target:
        tgt = capture_run(target, prompt, decode_steps)
    return compare(ref, tgt, tolerance, tp, pp)


def print_table(report: CheckReport) -> None:
    print(f"{'step':>4} {'layer':>5}  {'site':<16} {'relative diff':>13} {'partial sums':>13}  rank")
    for d in report.sites:
        partial = "" if d.partial_rel_diff is None else f"{d.partial_rel_diff:.3e}"
        mark = "  <-- diverges" if not d.max_rel_diff <= report.tolerance else ""
        print(f"{d.step:>4} {d.layer:>5}  {d.site:<16} {d.max_rel_diff:>13.3e} {partial:>13}  {d.rank}{mark}")


def check_main(args) -> int:
    from devharness.engine.args import EngineArgs
    kw = EngineArgs.from_cli_args(args).kwargs()
    model = kw.pop("model")
    if kw["tensor_parallel_size"] * kw["pipeline_parallel_size"] == 1 and kw["distributed_executor_backend"] in (None, "uni"):
        raise ValueError("check compares a layout with tp=1, pp=1: give --tp or --pp above 1 (or --executor mp|ray)")
    if args.decode_steps < 0:
        raise ValueError(f"--decode-steps {args.decode_steps}: give 0 (prefill only) or more decode steps")
    if args.tolerance is not None and not args.tolerance > 0:
        raise ValueError(f"--tolerance {args.tolerance}: give a relative difference above 0, like 1e-4")
    if kw["distributed_executor_backend"] is None:
        kw["distributed_executor_backend"] = "mp"
    tol = args.tolerance if args.tolerance is not None else (1e-4 if kw["dtype"] == "float32" else 3e-2)
    report = run_check(model, args.prompt, tol, args.decode_steps, **kw)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        if args.table:
            print_table(report)
        print(report.verdict())
    return 0 if report.ok else 1
