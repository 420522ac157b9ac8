"""`devharness check`: what changes the answer. Three questions, one comparison engine, one report:

- **layout** (`--tp N --pp N`): one prompt through a tp x pp layout and through tp=1, pp=1; every layer's
  attention output, MLP output and residual stream, on the prefill (step 0) and N decode steps (1..N); names
  the first (step, layer, site) where they part and the rank to blame.
- **kernels** (`--kernels fast --against reference`): the same layout twice, once per kernel backend; every op
  of the kernel registry, call by call; names the first (step, layer, site, op) where they part.
- **batch** (`--batch-invariance`): each probe request alone, then again inside a batch of others (other
  lengths, a chunked prefill beside it, a preemption), on one engine; every op's rows of the probe, token
  position by token position, bit for bit unless `--tolerance`; names the first (step, layer, site, op) where
  the probe's numbers depend on its batch, and whether its tokens do.

Each builds Captured runs, compares them with `compare_keys` (per key, rank by rank: max |target - reference| /
max |reference|) into a CheckReport: a one-line verdict, `--table` (every key compared) and `--json`. The
probe and the batch plan are fitted to the model's context first (check_fit.py); the verdict says what changed.

Layout blame: at tp > 1 each rank's partial sum (its o_proj / down_proj share before the all-reduce) is compared
with the partial sum the reference computes from the same slice of its full weights; the first rank whose
partial parts is named. Else the first rank whose copy of the site parts (a rank that skipped the
all-reduce, or the one stage that ran the layer under pp).

Decode steps: each run decodes greedily on its own. Step k (k >= 1) feeds the token sampled at step k - 1,
so it is compared only while both runs sampled the same tokens before it; tokens that part mean an earlier
site already diverged, or differences within tolerance tipped a near tie.

Triage of a flipped token: at the first step whose sampled token differs (its inputs still agree), the captured
logits of both runs give the reference's top-1/top-2 margin m and the largest logit difference d. A difference
the check accepts as numerics (a relative difference within the tolerance, or within the dtype's default
tolerance where the check compares bit for bit) moves each logit by at most noise * max|reference logit|, and
the top-1/top-2 margin by twice that; so the bound is 2 * min(d, noise * max|logit|): the margin the measured
difference, counted only up to the numerics' share, can close. m <= bound: a near-tie (summation order could
flip it); else structural (the flip needed a difference beyond numerics).
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field

import numpy as np

from devharness.monitor.check_fit import batch_budget, check_plan_fits, context_of, fit_probe
from devharness.protocol.messages import ArmCapture, TakeCapture

SITES = {"attention": "attention output", "mlp": "MLP output", "residual": "residual stream"}
_ORDER = {site: i for i, site in enumerate(SITES)}
# Where an op runs (debug/capture.py's sites), in the order a forward runs them.
OP_SITES = {"embedding": "embedding", "attention": "attention", "mlp": "MLP", "final": "final norm",
            "head": "LM head"}
_OP_ORDER = {site: i for i, site in enumerate(OP_SITES)}
# Ops whose call index names a group of rows (a decode group, a prompt chunk), not a place in the layer.
_GROUPED_OPS = ("paged_decode", "prefill_attention")
MODES = ("layout", "kernels", "batch", "prefix")   # prefix: check_prefix.py


@dataclass
class Captured:
    """One run's activations: key -> rank -> values, and its sampled tokens. Layout keys: (step, layer, site,
    shard or None for the full tensor); op keys: (step, layer, site, op, call) with one row per token position
    (`positions`: key -> the positions of its rows, `order`: key -> where it ran among the rank's calls)."""

    tensors: dict[tuple, dict[int, np.ndarray]]
    tokens: list[int]
    positions: dict[tuple, list[int]] = field(default_factory=dict)
    order: dict[tuple, int] = field(default_factory=dict)
    alone: dict[tuple, float] = field(default_factory=dict)   # key -> its rows in their call vs alone (max over ranks)
    logits: dict[int, np.ndarray] = field(default_factory=dict)   # step -> the logits of its sampled row


@dataclass
class SiteDiff:
    """One key compared on every rank that holds it; `rank` is the one to blame."""

    step: int
    layer: int | None                # None: after the layers (the final norm, the LM head)
    site: str                        # a value of SITES, or of OP_SITES for an op
    rel_diff: float                  # the blamed rank's max |target - reference| / max |reference|
    max_rel_diff: float              # the largest over every rank's copy and partial sum of this key
    rank: int
    tp_rank: int
    pp_rank: int
    partial_rel_diff: float | None = None   # the blamed rank's partial sum, where tp > 1 and the site has one
    op: str | None = None            # the kernel registry's op (kernel and batch checks)
    call: int = 0                    # which of the op's calls in this layer and site (0: the first)
    position: int | None = None      # batch check: the probe's token position
    batch_step: int | None = None    # batch check: the batched run's step that computed it
    alone_diff: float | None = None  # batch check: the op on the probe's rows alone vs in their batched call

    @property
    def where(self) -> str:
        layer = "" if self.layer is None else f"layer {self.layer}, "
        op = "" if self.op is None else f", op {self.op}" + (f" (call {self.call + 1})" if self.call else "")
        return f"step {self.step}, {layer}{self.site}{op}"


Diff = SiteDiff


def default_tolerance(dtype: str) -> float:
    """The relative difference summation order makes in `dtype` (the layout and kernel checks' tolerance)."""
    return 1e-4 if dtype == "float32" else 3e-2


@dataclass
class Triage:
    """The first flipped token weighed by its logit margin (the module docstring's rule)."""

    kind: str                 # "near-tie" | "structural"
    step: int                 # the first step whose sampled token differs
    margin: float             # the reference's top-1 minus top-2 logit there
    target_margin: float      # the target's
    bound: float              # 2 * min(max_logit_diff, noise * max |reference logit|)
    max_logit_diff: float     # max |target logit - reference logit| there
    noise: float              # the relative difference counted as numerics
    tokens: tuple[int, int]   # (reference's, target's) token there

    def verdict(self, reference: str, target: str) -> str:
        within = "within" if self.kind == "near-tie" else "beyond"
        return (f"step {self.step}'s token flip is {'a near-tie' if self.kind == 'near-tie' else 'structural'}: "
                f"top-1/top-2 logit margin {self.margin:.2g} ({reference}), {self.target_margin:.2g} ({target}), "
                f"{within} the bound {self.bound:.2g}")

    def to_json(self) -> dict:
        def num(x: float) -> float | None:
            return x if np.isfinite(x) else None
        return {"kind": self.kind, "step": self.step, "margin": num(self.margin),
                "target_margin": num(self.target_margin), "bound": num(self.bound),
                "max_logit_diff": num(self.max_logit_diff), "noise": self.noise,
                "tokens": {"reference": self.tokens[0], "target": self.tokens[1]}}


def _margin(logits: np.ndarray) -> float:
    top = np.partition(logits.astype(np.float64), -2)[-2:]
    return float(top[1] - top[0])


def triage(ref: Captured, tgt: Captured, noise: float) -> Triage | None:
    """The first step whose sampled token differs, weighed by both runs' logits there (None: no token differs,
    or a run kept no logits for it)."""
    step = next((i for i, (a, b) in enumerate(zip(ref.tokens, tgt.tokens)) if a != b), None)
    if step is None or step not in ref.logits or step not in tgt.logits:
        return None
    r, t = ref.logits[step].astype(np.float64), tgt.logits[step].astype(np.float64)
    if r.shape != t.shape or r.size < 2:
        return None
    diff = float(np.abs(t - r).max())
    diff = diff if np.isfinite(diff) else float("inf")
    bound = 2 * min(diff, noise * float(np.abs(r).max()))
    margin = _margin(r)
    kind = "near-tie" if margin <= bound else "structural"   # a NaN margin or bound: structural
    return Triage(kind, step, margin, _margin(t), bound, diff, noise, (ref.tokens[step], tgt.tokens[step]))


@dataclass
class CheckReport:
    sites: list[SiteDiff]            # in the order the forward computes them
    reference_tokens: list[int]
    target_tokens: list[int]
    tolerance: float
    tp_size: int
    pp_size: int
    mode: str = "layout"             # MODES
    target: str = ""                 # what was checked and against what, for the verdict
    reference: str = "tp=1"
    about: dict = field(default_factory=dict)   # the batch check: what the batch held
    fitted: list[str] = field(default_factory=list)   # what was changed to fit the model's context (check_fit.py)
    triage: Triage | None = None     # the first flipped token weighed by its logit margin

    @property
    def first_divergent(self) -> SiteDiff | None:
        return next((d for d in self.sites if not d.max_rel_diff <= self.tolerance), None)

    @property
    def ok(self) -> bool:
        return self.first_divergent is None and self.reference_tokens == self.target_tokens

    def site(self, step: int, layer: int, site: str, op: str | None = None, call: int = 0) -> SiteDiff:
        return next(d for d in self.sites if (d.step, d.layer, d.site) == (step, layer, site)
                    and (op is None or (d.op, d.call) == (op, call)))

    @property
    def max_rel_diff(self) -> float:
        return max((d.max_rel_diff for d in self.sites), default=0.0)

    def max_rel_diff_per_op(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for d in self.sites:
            if d.op is not None:
                out[d.op] = max(out.get(d.op, 0.0), d.max_rel_diff)
        return out

    def _tolerance(self) -> str:
        return "bit for bit" if self.tolerance == 0 else f"tolerance {self.tolerance:.0e}"

    def _tokens_part(self) -> int | None:
        """The first step whose sampled token differs (None: the same tokens)."""
        if self.reference_tokens == self.target_tokens:
            return None
        return next((i for i, (a, b) in enumerate(zip(self.target_tokens, self.reference_tokens)) if a != b),
                    min(len(self.target_tokens), len(self.reference_tokens)))

    def verdict(self) -> str:
        notes = ([self.triage.verdict(self.reference, self.target)] if self.triage is not None else []) + self.fitted
        return self._verdict() + "".join(f"; {note}" for note in notes)

    def _verdict(self) -> str:
        first, step = self.first_divergent, self._tokens_part()
        tokens = ""
        if self.mode == "batch":
            tokens = "; its tokens are the same" if step is None else f"; its tokens differ from step {step}"
        if first is not None:
            at = "" if first.position is None else f" (token position {first.position}, batched step {first.batch_step})"
            return (f"check: diverges at {first.where}, rank {first.rank} (tp {first.tp_rank}, pp {first.pp_rank})"
                    f"{at}: relative diff {first.rel_diff:.2g}{tokens}")
        if step is not None:
            if step >= min(len(self.target_tokens), len(self.reference_tokens)):
                return (f"check: {self.reference} sampled {len(self.reference_tokens)} tokens, "
                        f"{self.target} {len(self.target_tokens)}")
            return (f"check: every {'op' if self.mode != 'layout' else 'site'} matches ({self._tolerance()}), but "
                    f"step {step} sampled token {self.target_tokens[step]} where {self.reference} sampled "
                    f"{self.reference_tokens[step]}")
        if self.mode == "layout":
            return (f"check: tp={self.tp_size} pp={self.pp_size} matches tp=1 at every layer "
                    f"(max relative diff {self.max_rel_diff:.0e}, tolerance {self.tolerance:.0e})")
        per_op = ", ".join(f"{op} {v:.0e}" for op, v in sorted(self.max_rel_diff_per_op().items()))
        if self.mode == "kernels":
            return (f"check: {self.target} match {self.reference} at every op (tp={self.tp_size} pp={self.pp_size}, "
                    f"{self._tolerance()}); largest relative diff per op: {per_op}")
        return (f"check: {self.target} is batch-invariant at every op (tp={self.tp_size} pp={self.pp_size}, "
                f"{self._tolerance()}){tokens}")

    def to_json(self) -> dict:
        first = self.first_divergent
        fields = ("step", "layer", "site", "op", "call", "rank", "tp_rank", "pp_rank", "rel_diff",
                  "partial_rel_diff", "position", "batch_step")
        out = {"ok": self.ok, "mode": self.mode, "verdict": self.verdict(), **{f: None for f in fields}}
        if first is not None:
            out.update({f: asdict(first)[f] for f in fields})
        out.update(max_rel_diff=self.max_rel_diff, tolerance=self.tolerance,
                   tokens={"target": self.target_tokens, "reference": self.reference_tokens}, fitted=self.fitted,
                   triage=None if self.triage is None else self.triage.to_json())
        if self.mode != "layout":
            out["max_rel_diff_per_op"] = self.max_rel_diff_per_op()
        if self.mode == "batch":
            out["ops"] = self.op_summary()
        if self.about:
            out["about"] = self.about
        return out

    def op_summary(self) -> list[dict]:
        """Per op, in the order first met: the rows (or calls) compared, how many parted beyond the tolerance,
        the largest relative difference and where it first parted; in a batch check, also how many of the
        probe's rows ran in a call beside other rows (in_batch), and how many of those the op alone, on the same
        inputs, gave other numbers (alone_parted, max_alone_diff): whether the op itself depends on the batch."""
        out: dict[str, dict] = {}
        for d in self.sites:
            s = out.setdefault(d.op, {"op": d.op, "compared": 0, "parted": 0, "max_rel_diff": 0.0, "first": None,
                                      "in_batch": 0, "alone_parted": 0, "max_alone_diff": None})
            s["compared"] += 1
            if d.alone_diff is not None:
                s["in_batch"] += 1
                s["max_alone_diff"] = max(s["max_alone_diff"] or 0.0, d.alone_diff)
                s["alone_parted"] += not d.alone_diff <= self.tolerance
            s["max_rel_diff"] = max(s["max_rel_diff"], d.max_rel_diff)
            if not d.max_rel_diff <= self.tolerance:
                s["parted"] += 1
                s["first"] = s["first"] or d.where
        return list(out.values())

    def table(self) -> list[str]:
        if self.mode == "batch":   # per op: a row per token position would be thousands of lines
            lines = [f"{'op':<18} {'invariant':<9} {'batched':>7} {'own diff':>9}  {'rows':>5} {'differ':>6} "
                     f"{'max rel diff':>12}  first differs at"]
            for s in self.op_summary():
                own = "-" if s["max_alone_diff"] is None else f"{s['max_alone_diff']:.1e}"
                invariant = "-" if not s["in_batch"] else "no" if s["alone_parted"] else "yes"
                lines.append(f"{s['op']:<18} {invariant:<9} {s['in_batch']:>7} {own:>9}  {s['compared']:>5} "
                             f"{s['parted']:>6} {s['max_rel_diff']:>12.3e}  {s['first'] or '-'}")
            step = self._tokens_part()
            lines.append(f"{'greedy tokens':<18} {'yes' if step is None else 'no':<9} {'':>7} {'':>9}  "
                         f"{len(self.target_tokens):>5} {0 if step is None else len(self.target_tokens) - step:>6}"
                         f" {'':>12}  {'-' if step is None else f'step {step}'}")
            return lines
        ops = self.mode != "layout"
        head = f"{'step':>4} {'layer':>5}  {'site':<16} " + (f"{'op':<20}" if ops else "")
        lines = [head + f"{'relative diff':>13} {'partial sums':>13}  rank"]
        for d in self.sites:
            partial = "" if d.partial_rel_diff is None else f"{d.partial_rel_diff:.3e}"
            mark = "  <-- diverges" if not d.max_rel_diff <= self.tolerance else ""
            layer = "-" if d.layer is None else d.layer
            op = "" if not ops else f"{(d.op or '') + (f'#{d.call + 1}' if d.call else ''):<20}"
            lines.append(f"{d.step:>4} {layer:>5}  {d.site:<16} {op}{d.max_rel_diff:>13.3e} {partial:>13}  "
                         f"{d.rank}{mark}")
        return lines


# -- the comparison engine ---------------------------------------------------------------------------

def rel_diff(ref: np.ndarray | None, tgt: np.ndarray) -> float:
    """max |tgt - ref| / max |ref| (0 when equal, bit for bit; inf when ref is missing or shaped otherwise)."""
    if ref is None or ref.shape != tgt.shape:
        return float("inf")
    if np.array_equal(ref, tgt):
        return 0.0
    return float(np.abs(tgt - ref).max()) / max(float(np.abs(ref).max()), 1e-30)


def compare_keys(keys: list[tuple], ref: dict[tuple, dict[int, np.ndarray]], tgt: dict[tuple, dict[int, np.ndarray]],
                 tolerance: float, tp_size: int, make, ref_rank=None, partials=None) -> list[SiteDiff]:
    """Every key of `keys`, in order: each target rank's values against the reference's (its rank `ref_rank(rank)`;
    default the same rank), and, where `partials(key)` gives them, each rank's partial sum against the
    reference's ({rank: rel diff}). The first rank whose partial parts is blamed, else the first whose copy parts.
    `make(key)` gives the SiteDiff's fields of the key but the numbers (step, layer, site, ...)."""
    out = []
    for key in keys:
        reference = ref.get(key, {})
        copies = {rank: rel_diff(reference.get(rank if ref_rank is None else ref_rank(rank)), t)
                  for rank, t in sorted(tgt[key].items())}
        parts = partials(key) if partials is not None else {}
        parted = [r for r in sorted(parts) if not parts[r] <= tolerance]
        parted = parted or [r for r in copies if not copies[r] <= tolerance] or [min(copies)]
        blame = parted[0]
        out.append(SiteDiff(**make(key), rel_diff=copies[blame], max_rel_diff=max([*copies.values(), *parts.values()]),
                            rank=blame, tp_rank=blame % tp_size, pp_rank=blame // tp_size,
                            partial_rel_diff=parts.get(blame)))
    return out


def comparable_steps(ref_tokens: list[int], tgt_tokens: list[int]) -> int:
    """Steps whose inputs agree: step k >= 1 decodes the token step k - 1 sampled."""
    return next((k for k in range(1, len(ref_tokens)) if ref_tokens[:k] != tgt_tokens[:k]), len(ref_tokens))


# -- runs -----------------------------------------------------------------------------------------------

def _greedy(n: int):
    from devharness import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _run(llm, requests: list[tuple[str, object, object]]) -> dict[str, list[int]]:
    """Run (request id, prompt, SamplingParams) to completion on `llm`'s engine under the given ids; each one's
    tokens."""
    engine = llm.engine
    pending = {engine.add_request(prompt, params, rid) for rid, prompt, params in requests}
    try:   # the runner steps it, as LLM.generate does
        finals = llm.runner.run_until_idle(pending)
    except BaseException:
        for rid in pending:
            with contextlib.suppress(Exception):
                engine.abort_request(rid)
        raise
    return {rid: list(out.outputs[0].token_ids) for rid, out in finals.items()}


def _captured(llm, arm: ArmCapture, run) -> tuple[object, list]:
    """Arm `arm` on every worker, call run(); what it returned, and what every rank kept (a list per rank)."""
    workers = llm.engine.workers
    workers.control(arm)   # on this engine's workers' models only: it goes with them (the next arm replaces it)
    result = run()
    return result, workers.control(TakeCapture())


def capture_run(llm, prompt, decode_steps: int, split: int | None = None) -> Captured:
    """`prompt`'s prefill and `decode_steps` greedy decode steps on `llm`, every site of every rank captured
    (`split`: see ArmCapture)."""
    out, kept = _captured(llm, ArmCapture(split), lambda: llm.generate([prompt], _greedy(decode_steps + 1)))
    tensors, logits = sites_of(kept)
    return Captured(tensors, list(out[0].outputs[0].token_ids), logits=logits)


def sites_of(kept: list) -> tuple[dict[tuple, dict[int, np.ndarray]], dict[int, np.ndarray]]:
    """What every rank kept by site: key (step, layer, site, shard) -> rank -> values, and step -> the logits
    of its sampled row (any last-stage rank's: under tp they are gathered, the same on each)."""
    tensors: dict[tuple, dict[int, np.ndarray]] = {}
    logits: dict[int, np.ndarray] = {}
    for rank, per_rank in enumerate(kept):
        for c in per_rank:
            values = np.frombuffer(c.data, dtype=np.float32).reshape(c.shape)
            if c.site == "logits":
                logits.setdefault(c.step, values[-1])
            else:
                tensors.setdefault((c.step, c.layer, c.site, c.shard), {})[rank] = values
    return tensors, logits


def capture_ops(llm, requests: list[tuple[str, object, object]], keep: str,
                alone: bool = False) -> tuple[Captured, dict, list]:
    """Run `requests` on `llm` with every op captured, and keep request `keep`'s rows: one Captured whose keys
    are (step, layer, site, op, call), with the rows' positions (`alone`: and each op's rows of `keep` in their
    call against the op run on them alone); also every request's tokens and each rank's raw list."""
    tokens, kept = _captured(llm, ArmCapture(ops=True, requests=[keep], alone=alone), lambda: _run(llm, requests))
    cap = Captured({}, tokens[keep])
    logits: dict[int, np.ndarray] = {}   # the sampled row's position -> its logits
    for rank, per_rank in enumerate(kept):
        for i, c in enumerate(per_rank):
            if c.site == "logits":
                if c.request == keep:
                    logits.setdefault(c.position, np.frombuffer(c.data, dtype=np.float32).reshape(-1))
                continue
            key = (c.step, None if c.layer < 0 else c.layer, c.site, c.op, c.call)
            cap.tensors.setdefault(key, {})[rank] = np.frombuffer(c.data, dtype=np.float32).reshape(c.shape)
            cap.positions[key] = list(range(c.position, c.position + c.shape[0]))
            cap.order.setdefault(key, i)
            if c.alone_diff is not None:
                cap.alone[key] = max(cap.alone.get(key, 0.0), c.alone_diff)
    # The first sampled row is the prompt's last (step 0); step k samples k positions later.
    cap.logits = {position - min(logits): row for position, row in logits.items()} if logits else {}
    return cap, tokens, kept


def _layer_order(layer: int | None, site: str) -> int:
    """Where a layer's ops run in a forward: the embedding's (no layer) first, the final norm's and head's last."""
    return layer if layer is not None else -1 if site == "embedding" else 1 << 30


def _op_sort(key: tuple, order: dict) -> tuple:
    step, layer, site, _, _ = key
    return step, _layer_order(layer, site), _OP_ORDER[site], order.get(key, 0)


# -- layout ---------------------------------------------------------------------------------------------

def compare(ref: Captured, tgt: Captured, tolerance: float, tp_size: int, pp_size: int) -> CheckReport:
    """Every site the target captured against the reference (captured with split=tp_size) at tp=1."""
    steps = comparable_steps(ref.tokens, tgt.tokens)
    full = sorted((k for k in tgt.tensors if k[3] is None and k[0] < steps), key=lambda k: (k[0], k[1], _ORDER[k[2]]))
    if missing := sorted({k for k in ref.tensors if k[3] is None and k[0] < steps} - set(full)):
        raise RuntimeError(f"the target captured no activations for (step, layer, site) {missing[:4]}")

    def partials(key):   # rank -> its partial sum against the reference's same shard (tp > 1)
        step, layer, site, _ = key
        out = {}
        for shard in range(tp_size if tp_size > 1 else 0):
            for rank, t in tgt.tensors.get((step, layer, site, shard), {}).items():
                out[rank] = rel_diff(ref.tensors.get((step, layer, site, shard), {}).get(0), t)
        return out

    sites = compare_keys(full, ref.tensors, tgt.tensors, tolerance, tp_size,
                         lambda k: {"step": k[0], "layer": k[1], "site": SITES[k[2]]}, ref_rank=lambda rank: 0,
                         partials=partials)
    return CheckReport(sites, ref.tokens, tgt.tokens, tolerance, tp_size, pp_size, "layout",
                       f"tp={tp_size} pp={pp_size}", "tp=1", triage=triage(ref, tgt, tolerance))


def run_check(model: str, prompt, tolerance: float, decode_steps: int = 4, reference_model: str | None = None,
              **target_kwargs) -> CheckReport:
    """`reference_model` (default: `model`) runs at tp=1, pp=1 in process; `model` with target_kwargs."""
    from devharness import LLM
    # Both on the target's device: a GPU layout is checked against the same GPU at tp=1, not against the CPU.
    common = {k: target_kwargs.pop(k) for k in ("dtype", "seed", "max_model_len", "device", "kernels")
              if k in target_kwargs}
    tp, pp = target_kwargs.get("tensor_parallel_size", 1), target_kwargs.get("pipeline_parallel_size", 1)
    with LLM(reference_model or model, distributed_executor_backend="uni", **common) as ref_llm:
        ref = capture_run(ref_llm, prompt, decode_steps, split=tp)
    with LLM(model, **common, **target_kwargs) as target:
        tgt = capture_run(target, prompt, decode_steps)
    return compare(ref, tgt, tolerance, tp, pp)


# -- kernels --------------------------------------------------------------------------------------------

def compare_ops(ref: Captured, tgt: Captured, tolerance: float, tp_size: int, pp_size: int,
                target: str, reference: str) -> CheckReport:
    """Two runs of one layout, op call by op call, rank against the same rank (kernel check)."""
    steps = comparable_steps(ref.tokens, tgt.tokens)
    keys = sorted((k for k in tgt.tensors if k[0] < steps), key=lambda k: _op_sort(k, tgt.order))
    if missing := sorted({k for k in ref.tensors if k[0] < steps} - set(keys), key=str):
        raise RuntimeError(f"{target} made no calls of (step, layer, site, op, call) {missing[:4]} "
                           f"that {reference} made")
    sites = compare_keys(keys, ref.tensors, tgt.tensors, tolerance, tp_size,
                         lambda k: {"step": k[0], "layer": k[1], "site": OP_SITES[k[2]], "op": k[3], "call": k[4]})
    return CheckReport(sites, ref.tokens, tgt.tokens, tolerance, tp_size, pp_size, "kernels", target, reference,
                       triage=triage(ref, tgt, tolerance))


def run_kernel_check(model: str, prompt, tolerance: float, decode_steps: int, kernels: str, against: str,
                     **kwargs) -> CheckReport:
    """`prompt` on one layout (kwargs) twice: with the `against` kernels, then with `kernels`; op by op."""
    from devharness import LLM
    runs = {}
    for backend in (against, kernels):
        with LLM(model, kernels=backend, **kwargs) as llm:
            runs[backend], _, _ = capture_ops(llm, [("check", prompt, _greedy(decode_steps + 1))], "check")
    tp, pp = kwargs.get("tensor_parallel_size", 1), kwargs.get("pipeline_parallel_size", 1)
    return compare_ops(runs[against], runs[kernels], tolerance, tp, pp, f"{kernels} kernels", f"{against} kernels")


# -- batch invariance ---------------------------------------------------------------------------------------

PROBE = "probe"


@dataclass
class BatchPlan:
    """The probe and the requests run beside it, and the engine settings that make the batch chunk a prefill
    and preempt a request (a small step budget and KV cache)."""

    probe: object
    probe_params: object
    others: list[tuple[str, object, object]]
    engine: dict

    def requests(self, probe_params=None) -> list[tuple[str, object, object]]:
        """The probe first (the scheduler preempts the latest started: never the probe), then the others."""
        return [(PROBE, self.probe, probe_params or self.probe_params), *self.others]


def batch_plan(prompt_ids: list[int], decode_steps: int, block_size: int, vocab_size: int,
               max_num_batched_tokens: int = 1024, context: int | None = None) -> BatchPlan:
    """Beside the probe (its prompt, `decode_steps` decodes), in arrival order: a prompt one and a half step
    budgets long (its prefill is chunked over the probe's first two steps, beside its first decode), a short
    prompt decoding long and a medium one, in a KV cache as large as what they hold after the second step: in
    the third, the long prompt's first decode needs a block and the latest started request is preempted
    (computed again later, beside other requests). The step budget is check_fit.batch_budget's (the engine's, at
    most 16 blocks, fitted to `context` positions). No prompt shares a prefix with another."""
    def ids(n: int, first: int) -> dict:
        return {"prompt_token_ids": [(first + 7 * i) % vocab_size for i in range(n)]}
    bs, probe_len = block_size, len(prompt_ids)
    budget = batch_budget(bs, max_num_batched_tokens, context)
    chunked = budget + budget // 2
    others = [("chunked", ids(chunked, 203), _greedy(bs)),
              ("short", ids(3, 101), _greedy(2 * bs)),
              ("medium", ids(bs - 2, 307), _greedy(2 * bs))]
    # Blocks held after the second step: the probe's, the chunked prompt's, the short one's, and the medium
    # one's where the second step's budget had room for its first chunk.
    second_step_left = budget - 1 - (chunked - max(0, budget - probe_len)) - 3
    blocks = -(-probe_len // bs) + chunked // bs + 1 + (1 if second_step_left > 0 else 0)
    largest = max(-(-(probe_len + decode_steps + 1) // bs),
                  *(-(-(len(p["prompt_token_ids"]) + sp.max_tokens) // bs) for _, p, sp in others))
    return BatchPlan({"prompt_token_ids": list(prompt_ids)}, _greedy(decode_steps + 1), others,
                     {"max_num_batched_tokens": budget, "num_kv_blocks": max(blocks, largest),
                      "enable_prefix_caching": False})


def prompt_ids(model: str, prompt) -> list[int]:
    """`prompt`'s token ids as the engine reads them (a string through the model's tokenizer)."""
    if isinstance(prompt, dict):
        return list(prompt["prompt_token_ids"])
    from devharness.model.loader import load_tokenizer, resolve_model
    tokenizer = load_tokenizer(resolve_model(model))
    if tokenizer is None:
        raise ValueError(f"model {model} has no tokenizer: give the prompt as token ids")
    return tokenizer.encode(prompt)


def batch_engine_kwargs(plan_kwargs: dict, kwargs: dict) -> dict:
    return {**kwargs, **plan_kwargs}


def compare_batch(alone: Captured, batched: Captured, tolerance: float, tp_size: int, pp_size: int,
                  prompt_len: int, about: dict, dtype: str = "float32") -> CheckReport:
    """The probe alone against the probe in the batch, row by token position. Keys are aligned on (layer, site,
    op, call, position): a grouped op (attention) on the position alone, as its call index names a group. The
    report's step is the probe's own (0: its prompt, k: its k-th decode); a position computed twice in the batch
    (a preemption's recompute) is compared each time."""
    steps = comparable_steps(alone.tokens, batched.tokens)
    limit = prompt_len + steps - 1   # positions whose inputs agree

    def rows(cap: Captured):
        out: dict[tuple, list] = {}
        for key, by_rank in cap.tensors.items():
            step, layer, site, op, call = key
            for i, position in enumerate(cap.positions[key]):
                if position >= limit:
                    continue
                k = (layer, site, op, 0 if op in _GROUPED_OPS else call, position)
                out.setdefault(k, []).append((step, cap.order.get(key, 0), {r: t[i:i + 1] for r, t in by_rank.items()},
                                              cap.alone.get(key)))
        return out

    ref_rows, tgt_rows = rows(alone), rows(batched)
    if missing := sorted(set(ref_rows) - set(tgt_rows), key=str):
        raise RuntimeError(f"the batched probe made no calls of (layer, site, op, call, position) {missing[:4]}")

    def own_step(position: int) -> int:
        return max(0, position - prompt_len + 1)

    entries = []   # (sort key, key, batched step, values by rank)
    for k, occurrences in tgt_rows.items():
        layer, site, op, call, position = k
        for step, order, values, alone_diff in occurrences:
            entries.append(((own_step(position), _layer_order(layer, site), _OP_ORDER[site],
                             ref_rows[k][0][1] if k in ref_rows else order, position, step), k, step, values,
                            alone_diff))
    entries.sort(key=lambda e: e[0])
    ref_t = {i: ref_rows[e[1]][0][2] for i, e in enumerate(entries) if e[1] in ref_rows}
    tgt_t = {i: e[3] for i, e in enumerate(entries)}

    def make(i):
        layer, site, op, call, position = entries[i][1]
        return {"step": own_step(position), "layer": layer, "site": OP_SITES[site], "op": op, "call": call,
                "position": position, "batch_step": entries[i][2], "alone_diff": entries[i][4]}

    sites = compare_keys(list(range(len(entries))), ref_t, tgt_t, tolerance, tp_size, make)
    return CheckReport(sites, alone.tokens, batched.tokens, tolerance, tp_size, pp_size, "batch",
                       "the probe", "the probe alone", about,
                       triage=triage(alone, batched, tolerance or default_tolerance(dtype)))


def run_batch_check(model: str, prompt, tolerance: float, decode_steps: int, **kwargs) -> CheckReport:
    """The probe `prompt` alone, then in batch_plan's batch, on one engine (kwargs, with the plan's step budget
    and KV cache); op by op, position by position."""
    from devharness import LLM
    from devharness.engine.args import EngineArgs
    from devharness.model.loader import resolve_model
    cfg = EngineArgs.from_kwargs(model=model, **kwargs).create_engine_config()
    arch, bs, asked = resolve_model(model).arch, cfg.scheduler.block_size, cfg.scheduler.max_num_batched_tokens
    context, why = context_of(cfg, arch, kv_blocks=False)   # the plan sizes the KV cache
    check_plan_fits(context, why, bs)
    ids = prompt_ids(model, prompt)
    if len(ids) + decode_steps + 1 > context:
        raise ValueError(f"the probe ({len(ids)} tokens, {decode_steps} decode steps) does not fit {why}")
    plan = batch_plan(ids, decode_steps, bs, arch.vocab_size, asked, context)
    budget = plan.engine["max_num_batched_tokens"]
    fitted = [] if budget == batch_budget(bs, asked) else \
        [f"batch plan fitted to {why}: a step budget of {budget} tokens, a chunked prompt of {budget * 3 // 2}"]
    with LLM(model, **batch_engine_kwargs(plan.engine, kwargs)) as llm:
        alone, _, _ = capture_ops(llm, plan.requests()[:1], PROBE)
        before = llm.stats()["num_preemptions"]
        batched, tokens, _ = capture_ops(llm, plan.requests(), PROBE, alone=True)
        preemptions = llm.stats()["num_preemptions"] - before
    about = {"requests": len(plan.requests()), "preemptions": preemptions, "tokens": tokens,
             "prompt_lengths": [len(p["prompt_token_ids"]) for _, p, _ in plan.requests()], **plan.engine}
    tp, pp = kwargs.get("tensor_parallel_size", 1), kwargs.get("pipeline_parallel_size", 1)
    report = compare_batch(alone, batched, tolerance, tp, pp, len(ids), about, cfg.model.dtype)
    report.fitted = fitted
    return report


# -- the command ------------------------------------------------------------------------------------------

def print_table(report: CheckReport) -> None:
    print("\n".join(report.table()))


def fit_to_model(model: str, prompt, decode_steps: int, prompt_given: bool, steps_given: bool, batch: bool,
                 **kw) -> tuple[object, int, list[str]]:
    """The probe fitted to the context of `model`'s engine (kw), before any engine starts: the prompt (as given,
    or its first token ids where shortened), the decode steps, and what was changed (check_fit.fit_probe)."""
    from devharness.engine.args import EngineArgs
    from devharness.model.loader import resolve_model
    cfg = EngineArgs.from_kwargs(model=model, **kw).create_engine_config()   # a bad value, before any engine
    context, why = context_of(cfg, resolve_model(model).arch, kv_blocks=not batch)
    if batch:
        check_plan_fits(context, why, cfg.scheduler.block_size)
    ids = prompt_ids(model, prompt)
    fitted_ids, steps, notes = fit_probe(ids, decode_steps, context, why, prompt_given, steps_given)
    return (prompt if fitted_ids == ids else {"prompt_token_ids": fitted_ids}), steps, notes
