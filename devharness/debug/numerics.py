"""The numerics check (`--numerics-check`): where the first non-finite value of a step was born.

Worker side (NumericsCheck, a model hook): at each site of each layer (fault_spec.LAYER_SITES: the attention output
before its tp all-reduce and after it, the MLP output likewise, the residual stream) the rank takes each row's absmax
(one reduction; a row holding a nan or an inf has a non-finite absmax), and after the step the runner hands it the
sampled rows' logits too. The rows' absmax of every site are stacked into one small tensor and read once a step: the
per-site absmax goes into the rank's ring of its last steps (the bundle's numerics.json), and only when one is not
finite is the first site in the order the sites ran searched for its rows (request, token position). The output rank
returns its alarm with its step result; the driver then asks every rank for its record (GetNumerics) and `decide`s.

Driver side (`decide`): the value was born on the rank whose alarm comes first in execution order: the earliest
layer (an earlier pipeline stage runs earlier layers), then the earliest site in it (before the all-reduce comes
before after it: the rank whose own partial sum held it, not its tp peers, who saw it only in the sum). Only the
requests whose rows held a non-finite value end, each with an error naming step, rank, layer, site, op, request
and token position; the others go on.
"""
from __future__ import annotations

import collections
import logging
import threading

import torch

from devharness.fault_spec import LAYER_SITES
from devharness.model import hooks
from devharness.protocol.messages import NumericsAlarm, NumericsReport, NumericsStep

logger = logging.getLogger(__name__)

# What wrote the value each site looks at.
OPS = {"attention.partial": "o_proj", "attention": "attention all_reduce", "mlp.partial": "down_proj",
       "mlp": "mlp all_reduce", "residual": "residual add", "logits": "lm_head"}
SITE_ORDER = {**{s: i for i, s in enumerate(LAYER_SITES)}, "logits": len(LAYER_SITES)}
NON_FINITE_VALUE = "non-finite value"   # how its errors begin


def _value(x: float) -> str:
    return "nan" if x != x else "inf" if x > 0 else "-inf"


class NumericsCheck(hooks.ModelHooks):
    """One rank's check; `begin_step` before the forward, `logits` for the sampled rows, `end_step` after. The ring
    (`history_len` steps) is read by GetNumerics from any thread."""

    def __init__(self, info, history_len: int = 64):
        self.info = info
        self.sites: list[tuple[int, str]] = []   # (layer, site) in the order they ran, as in the last step
        self._keys: list[tuple[int, str]] = []
        self._rows: list[torch.Tensor] = []      # this step: each site's per-row absmax, in order
        self._logits: torch.Tensor | None = None
        self._layer = 0
        self._steps: collections.deque[NumericsStep] = collections.deque(maxlen=history_len)
        self._alarms: collections.deque[NumericsAlarm] = collections.deque(maxlen=history_len)
        self._lock = threading.Lock()

    # -- the model's sites: one reduction each --------------------------------------------------

    def _add(self, site: str, t: torch.Tensor) -> None:
        self._keys.append((self._layer, site))
        self._rows.append(t.abs().amax(dim=-1))

    def layer_start(self, layer: int) -> None:
        self._layer = layer

    def partial_output(self, site: str, partial: torch.Tensor) -> None:
        self._add(site + ".partial", partial)

    def sublayer_output(self, site: str, output: torch.Tensor) -> None:
        self._add(site, output)

    def layer_end(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        if residual is not None:
            self._add("residual", residual)

    # -- the step ----------------------------------------------------------------------------

    def begin_step(self) -> None:
        self._keys, self._rows, self._logits = [], [], None

    def logits(self, logits: torch.Tensor) -> None:
        """The sampled rows' logits (row i: the step's i-th sampled request)."""
        self._logits = logits.abs().amax(dim=-1)

    def end_step(self, step: int, req_rows: dict[str, tuple[int, int, int]],
                 sample_req_ids: list[str]) -> NumericsAlarm | None:
        """Read the step's absmax once; an alarm for the first site (in the order they ran) that held a non-finite
        value, else None. `req_rows`: request id -> (its first row, its rows, its first row's position)."""
        if not self._rows:
            return None
        stacked = torch.stack(self._rows)
        parts = [stacked.amax(dim=1)] + ([self._logits.amax().reshape(1).to(stacked.dtype)]
                                         if self._logits is not None and len(self._logits) else [])
        values = torch.cat(parts).float().tolist()   # the one read a step
        n = len(self._keys)
        entry = NumericsStep(step, values[:n], values[n] if len(values) > n else None)
        alarm = None
        if not all(abs(v) < float("inf") for v in values):   # False for nan and inf alike
            alarm = self._alarm(step, stacked, values, req_rows, sample_req_ids)
        with self._lock:
            self.sites = self._keys
            self._steps.append(entry)
            if alarm is not None:
                self._alarms.append(alarm)
        self.begin_step()
        return alarm

    def _alarm(self, step, stacked, values, req_rows, sample_req_ids) -> NumericsAlarm:
        n = len(self._keys)
        first = next(i for i, v in enumerate(values) if not abs(v) < float("inf"))
        row_max = stacked[first] if first < n else self._logits
        bad = (~torch.isfinite(row_max)).nonzero().flatten().tolist()
        by_row = sorted((start_row, rid, n_rows, pos) for rid, (start_row, n_rows, pos) in req_rows.items())
        rows = []
        for r in bad:
            if first < n:
                for start_row, rid, n_rows, pos in by_row:
                    if start_row <= r < start_row + n_rows:
                        rows.append((rid, pos + r - start_row))
                        break
            elif r < len(sample_req_ids):   # a logits row: its request's last row
                rid = sample_req_ids[r]
                start_row, n_rows, pos = req_rows[rid]
                rows.append((rid, pos + n_rows - 1))
        layer, site = self._keys[first] if first < n else (None, "logits")
        i = self.info
        alarm = NumericsAlarm(step=step, rank=i.rank, tp_rank=i.tp_rank, pp_rank=i.pp_rank, layer=layer, site=site,
                              op=OPS[site], value=_value(float(row_max[bad[0]])), rows=rows)
        logger.warning("numerics: %s", describe(alarm))
        return alarm

    def report(self) -> NumericsReport:
        i = self.info
        with self._lock:
            return NumericsReport(i.rank, i.tp_rank, i.pp_rank, list(self.sites), list(self._steps),
                                  list(self._alarms))


# -- the driver: where it was born, and whom it ends ------------------------------------------------

def _order(a: NumericsAlarm) -> tuple:
    return (a.layer if a.layer is not None else float("inf"), SITE_ORDER[a.site])


def describe(alarm: NumericsAlarm, also: list[NumericsAlarm] = ()) -> str:
    where = f"layer {alarm.layer} {alarm.site}" if alarm.layer is not None else "the logits"
    ranks = " and ".join(f"rank {a.rank} (tp {a.tp_rank}, pp {a.pp_rank})" for a in [alarm, *also])
    return f"{NON_FINITE_VALUE} ({alarm.value}) born in step {alarm.step} on {ranks}, at {where} ({alarm.op})"


def decide(step: int, reports: list[NumericsAlarm]) -> tuple[NumericsAlarm, str, dict[str, str]]:
    """Of every rank's alarms for `step`: (the born alarm, what was born where, {request id: the error it ends with}).
    The born alarm is the first in execution order; ranks whose alarm is as early (each born it alike) are named with
    it."""
    alarms = [a for a in reports if a.step == step]
    first = min(map(_order, alarms))
    born = sorted((a for a in alarms if _order(a) == first), key=lambda a: a.rank)
    summary = describe(born[0], born[1:])
    errors: dict[str, str] = {}
    born_rows = [row for a in born for row in a.rows]
    for a in sorted(alarms, key=_order):
        for rid, _ in a.rows:
            if rid in errors:
                continue
            own = next((pos for r, pos in born_rows if r == rid), None)
            if own is not None:
                errors[rid] = f"{summary}, request {rid!r} token position {own}"
            else:   # its rows took it later (where else would it come from?): named where they first held it
                pos = next(pos for r, pos in a.rows if r == rid)
                errors[rid] = (f"{summary}; request {rid!r} held it from layer {a.layer} {a.site} on rank {a.rank}, "
                               f"token position {pos}")
    return born[0], summary, errors


def to_json(reports: list[NumericsReport]) -> list[dict]:
    """The ranks' records for a bundle's numerics.json: per step, each "layer L site" and its absmax (non-finite
    values as the strings "nan", "inf")."""
    def num(v):
        return v if v is None or abs(v) < float("inf") else _value(v)

    out = []
    for r in reports:
        names = [f"layer {layer} {site}" for layer, site in r.sites]
        out.append({"rank": r.rank, "tp_rank": r.tp_rank, "pp_rank": r.pp_rank,
                    "alarms": [{"step": a.step, "layer": a.layer, "site": a.site, "op": a.op, "value": a.value,
                                "rows": [list(x) for x in a.rows]} for a in r.alarms],
                    "steps": [{"step": s.step, "absmax": dict(zip(names, map(num, s.absmax))),
                               "logits": num(s.logits)} for s in r.steps]})
    return out
