"""Planted bugs (`--inject SPEC`), so the debugging tools can be shown to find what was planted.

    allreduce-drop:layer=L:rank=R   rank R keeps its own partial sum instead of the all-reduce result at
                                    layer L's attention output
    rope-offset:rank=R              rank R rotates its queries one position off their keys' positions, at
                                    every layer it runs (p -> p - 1; position 0 -> 1). Both moved alike
                                    would change nothing: RoPE attention sees only relative positions
    kv-corrupt:layer=L:rank=R       the first time rank R writes layer L's KV cache, it scrambles the block
                                    holding the first token written (reverses each K and V head vector)
                                    after that step's attention: the steps that read the block after it
                                    (decodes) part at layer L's attention output
    raise:step=N:rank=R             rank R raises at the start of step N
    stall:step=N:rank=R[:seconds=S] rank R sleeps S seconds (default 30) in step N, where a peer waits for
                                    it: before its first layer's attention all-reduce (tp > 1: layer 0
                                    on the first stage), else before its pipeline send or receive (tp = 1)

A spec that does not parse, or names a rank or layer the engine does not have (or a layer that rank does
not run, or a stall with no peer to hold up), is a ValueError naming what is wrong. The worker plants a fault through the model's hooks
(model/hooks.py) or the collectives' fault hook; the model knows nothing of it.
"""
from __future__ import annotations

import time

import msgspec

from devharness.model import hooks

KINDS = {"allreduce-drop": ("layer", "rank"), "rope-offset": ("rank",), "kv-corrupt": ("layer", "rank"),
         "raise": ("step", "rank"), "stall": ("step", "rank", "seconds")}
OPTIONAL = ("seconds",)


class FaultSpec(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    rank: int
    layer: int | None = None
    step: int | None = None
    seconds: float = 30.0


def parse(text: str) -> FaultSpec:
    kind, *pairs = text.split(":")
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


def check_fits(spec: FaultSpec, world_size: int, num_layers: int, tp_size: int,
               layer_partition: list[int] | None = None) -> None:
    """ValueError when the spec names a rank or layer this engine does not have."""
    from devharness.model.decoder import stage_layer_range
    if spec.rank >= world_size:
        raise ValueError(f"--inject: rank {spec.rank} does not exist (ranks 0..{world_size - 1})")
    if spec.layer is not None and spec.layer >= num_layers:
        raise ValueError(f"--inject: layer {spec.layer} does not exist (layers 0..{num_layers - 1})")
    if spec.kind == "allreduce-drop" and tp_size == 1:
        raise ValueError("--inject allreduce-drop: needs tensor parallelism (tp > 1): there is no all-reduce")
    if spec.kind == "stall" and world_size == 1:
        raise ValueError("--inject stall: needs more than one rank (tp or pp > 1): a rank alone holds up no peer")
    if spec.layer is not None:
        pp_rank = spec.rank // tp_size
        start, end = stage_layer_range(num_layers, world_size // tp_size, pp_rank, layer_partition)
        if not start <= spec.layer < end:
            raise ValueError(f"--inject: rank {spec.rank} does not run layer {spec.layer} "
                             f"(its pipeline stage {pp_rank} runs layers {start}..{end - 1})")


class _RopeOffset(hooks.ModelHooks):
    def query_positions(self, layer: int, positions):
        return (positions - 1).abs()


class _KvCorrupt(hooks.ModelHooks):
    def __init__(self, layer: int) -> None:
        self.layer, self.done = layer, False

    def kv_written(self, layer: int, k_cache, v_cache, slots) -> None:
        if self.done or layer != self.layer or not len(slots):
            return
        self.done = True
        block = int(slots[0]) // k_cache.shape[1]
        k_cache[block] = k_cache[block].flip(-1)
        v_cache[block] = v_cache[block].flip(-1)


_planted = None   # the model hooks of the fault planted on this worker, if any


def install(spec: FaultSpec, rank: int, recorder) -> bool:
    """On the worker: plant `spec` if it names this rank; whether it did."""
    global _planted
    if spec.rank != rank:
        return False
    from devharness.debug import breakpoints
    from devharness.distributed import collectives
    from devharness.messages import BreakpointSpec
    if spec.kind == "raise":
        return breakpoints.arm_fault(BreakpointSpec(step=spec.step))
    if spec.kind == "rope-offset":
        _planted = hooks.install(_RopeOffset())
        return True
    if spec.kind == "kv-corrupt":
        _planted = hooks.install(_KvCorrupt(spec.layer))
        return True
    from devharness.distributed import parallel_state
    # Where a stall waits: the first layer's attention all-reduce this rank meets in the step (its TP peers
    # wait in it), or at tp = 1 its first pipeline send or receive (its neighbouring stage waits on it).
    stall_at = ("attention all_reduce",) if parallel_state.get_parallel_info().tp_size > 1 else ("send", "recv")
    stalled = False

    def fault(what: str) -> bool:
        nonlocal stalled
        if spec.kind == "allreduce-drop":
            return recorder.layer == spec.layer and what == "attention all_reduce"
        if not stalled and what in stall_at and recorder.state.step == spec.step:
            stalled = True
            time.sleep(spec.seconds)
        return False

    collectives.set_fault(fault)
    return True


def uninstall() -> None:
    """Remove what install() planted on this worker, a `raise` whose step has not come included."""
    global _planted
    from devharness.distributed import collectives
    collectives.set_fault(None)
    from devharness.debug import breakpoints
    breakpoints.clear_faults()
    if _planted is not None:
        hooks.remove(_planted)
        _planted = None
