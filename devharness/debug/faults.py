"""Planted bugs (`--inject SPEC`), so the debugging tools can be shown to find what was planted.

    allreduce-drop:layer=L:rank=R   rank R keeps its own partial sum instead of the all-reduce result at
                                    layer L's attention output
    raise:step=N:rank=R             rank R raises at the start of step N
    stall:step=N:rank=R[:seconds=S] rank R sleeps S seconds (default 30) before layer 0's attention
                                    all-reduce of step N, while its peers wait in it

rope-offset and kv-corrupt are named in the plan (issue 11) and refused until they exist. A spec that does
not parse, or names a rank or layer the engine does not have, is a ValueError naming what is wrong.
"""
from __future__ import annotations

import time

import msgspec

KINDS = {"allreduce-drop": ("layer", "rank"), "raise": ("step", "rank"), "stall": ("step", "rank", "seconds")}
OPTIONAL = ("seconds",)
PLANNED = ("rope-offset", "kv-corrupt")


class FaultSpec(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    rank: int
    layer: int | None = None
    step: int | None = None
    seconds: float = 30.0


def parse(text: str) -> FaultSpec:
    kind, *pairs = text.split(":")
    if kind in PLANNED:
        raise ValueError(f"--inject {text!r}: {kind} is not available yet (available: {', '.join(KINDS)})")
    if kind not in KINDS:
        raise ValueError(f"--inject {text!r}: unknown fault {kind!r} (one of {', '.join(KINDS)})")
    fields: dict = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or key not in KINDS[kind]:
            raise ValueError(f"--inject {text!r}: {pair!r} is not one of {', '.join(k + '=' for k in KINDS[kind])}")
        try:
            fields[key] = float(value) if key == "seconds" else int(value)
        except ValueError:
            raise ValueError(f"--inject {text!r}: {key} must be a number, not {value!r}") from None
        if fields[key] < 0 or (key == "step" and fields[key] < 1):
            raise ValueError(f"--inject {text!r}: {key}={value} is out of range")
    if missing := [k for k in KINDS[kind] if k not in fields and k not in OPTIONAL]:
        raise ValueError(f"--inject {text!r}: {kind} needs {', '.join(k + '=' for k in missing)}")
    return FaultSpec(kind=kind, **fields)


def check_fits(spec: FaultSpec, world_size: int, num_layers: int, tp_size: int) -> None:
    """ValueError when the spec names a rank or layer this engine does not have."""
    if spec.rank >= world_size:
        raise ValueError(f"--inject: rank {spec.rank} does not exist (ranks 0..{world_size - 1})")
    if spec.layer is not None and spec.layer >= num_layers:
        raise ValueError(f"--inject: layer {spec.layer} does not exist (layers 0..{num_layers - 1})")
    if spec.kind == "allreduce-drop" and tp_size == 1:
        raise ValueError("--inject allreduce-drop: needs tensor parallelism (tp > 1): there is no all-reduce")


def install(spec: FaultSpec, rank: int, recorder) -> None:
    """On the worker: plant `spec` if it names this rank."""
    if spec.rank != rank:
        return
    from devharness.debug import breakpoints
    from devharness.distributed import collectives
    from devharness.messages import BreakpointSpec
    if spec.kind == "raise":
        breakpoints.arm_fault(BreakpointSpec(step=spec.step))
        return
    stalled = False

    def fault(what: str) -> bool:
        nonlocal stalled
        if spec.kind == "allreduce-drop":
            return recorder.layer == spec.layer and what == "attention all_reduce"
        if not stalled and recorder.state.step == spec.step and recorder.layer == 0 and what == "attention all_reduce":
            stalled = True
            time.sleep(spec.seconds)
        return False

    collectives.set_fault(fault)
