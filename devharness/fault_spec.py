"""The words of a planted bug's spec (`--inject SPEC`, debug/faults.py lists the kinds), read without torch: the
engine config checks a spec with `parse` when it is made, and debug/faults.py plants what it reads."""
from __future__ import annotations

import math

import msgspec

KINDS = {"allreduce-drop": ("layer", "rank"), "collective-skip": ("layer", "rank"),
         "collective-shape": ("layer", "rank"), "rope-offset": ("rank",), "kv-corrupt": ("layer", "rank"),
         "raise": ("step", "rank"), "stall": ("step", "rank", "seconds"), "kernel": ("op", "rank", "blocks"),
         "batch-variant": ("op", "rank"), "kv-use-after-free": ("step",), "kv-leak": ("step",),
         "slow": ("rank", "ms", "layer", "step"), "kv-bitflip": ("layer", "rank", "step"),
         "kv-stale-hit": ("step",), "sched-strand": ("step",), "sched-thrash": ("step",),
         "nan": ("layer", "rank", "step", "site"), "inf": ("layer", "rank", "step", "site"),
         "overflow": ("layer", "rank")}
# Planted on the driver (its block manager, its scheduler), not in a worker.
DRIVER_KINDS = ("kv-use-after-free", "kv-leak", "kv-stale-hit", "sched-strand", "sched-thrash")
OPTIONAL = {"seconds": ..., "blocks": ..., "rank": ("kernel", "batch-variant", "kv-bitflip", "slow"),   # ...: every kind
            "layer": ("slow",), "site": ("nan", "inf"),
            "step": ("slow", "kv-bitflip", "kv-stale-hit", "sched-strand", "sched-thrash", "nan", "inf")}
# The ops each op-planting kind has a bug for.
KERNEL_BUG_OPS = ("paged_decode", "rms_norm", "q_linear")
BATCH_VARIANT_OPS = ("rms_norm", "add_rms_norm")
# The sites of a decoder layer where the numerics check (debug/numerics.py) looks, in the order they run, and where
# a nan or inf fault is planted: the attention output before its tp all-reduce (this rank's partial sum) and after
# it, the MLP output likewise, the residual stream at the layer's end. `logits` (after the layers) is checked only.
LAYER_SITES = ("attention.partial", "attention", "mlp.partial", "mlp", "residual")
MAX_SLOW_MS = 60_000.0   # slow: a minute a step at most (more is a stall: see stall)
_OPS_OF = {"kernel": KERNEL_BUG_OPS, "batch-variant": BATCH_VARIANT_OPS}


class FaultSpec(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    rank: int | None = None     # None: every rank (kernel, batch-variant, kv-bitflip, slow); driver faults name none
    layer: int | None = None
    step: int | None = None
    seconds: float = 30.0
    op: str | None = None
    blocks: int = 2
    ms: float = 0.0             # slow: the extra compute per step, in milliseconds
    site: str | None = None     # nan, inf: one of LAYER_SITES (None: attention.partial)


def parse(text: str, what: str | None = None) -> FaultSpec:
    """A spec's fields; a ValueError whose words begin with `what` (default: `--inject 'SPEC'`) if it is not one."""
    what = what or f"--inject {text!r}"
    if not isinstance(text, str):
        raise ValueError(f"{what}: a fault spec is a string like raise:step=5:rank=0")
    kind, *pairs = text.split(":")
    if kind not in KINDS:
        raise ValueError(f"{what}: unknown fault {kind!r} (one of {', '.join(KINDS)})")
    fields: dict = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or key not in KINDS[kind]:
            raise ValueError(f"{what}: {pair!r} is not one of {', '.join(k + '=' for k in KINDS[kind])}")
        if key == "site":
            if value not in LAYER_SITES:
                raise ValueError(f"{what}: unknown site {value!r} (one of {', '.join(LAYER_SITES)})")
            fields[key] = value
            continue
        if key == "op":
            if value not in _OPS_OF[kind]:
                raise ValueError(f"{what}: {kind} has no bug for op {value!r} "
                                 f"(one of {', '.join(_OPS_OF[kind])})")
            fields[key] = value
            continue
        try:
            fields[key] = float(value) if key in ("seconds", "ms") else int(value)
        except ValueError:
            raise ValueError(f"{what}: {key} must be a number, not {value!r}") from None
        if not math.isfinite(fields[key]) or fields[key] < 0 or (key in ("step", "blocks") and fields[key] < 1) \
                or (key == "ms" and not 0 < fields[key] <= MAX_SLOW_MS):
            raise ValueError(f"{what}: {key}={value} is out of range")
    if missing := [k for k in KINDS[kind] if k not in fields and not (
            OPTIONAL.get(k) is ... or kind in (OPTIONAL.get(k) or ()))]:
        raise ValueError(f"{what}: {kind} needs {', '.join(k + '=' for k in missing)}")
    return FaultSpec(kind=kind, **fields)
