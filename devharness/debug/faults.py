"""Planted bugs (`--inject SPEC`), so the debugging tools can be shown to find what was planted.

    allreduce-drop:layer=L:rank=R   rank R keeps its own partial sum instead of the all-reduce result at
                                    layer L's attention output
    rope-offset:rank=R              rank R rotates its queries one position off their keys' positions, at
                                    every layer it runs (p -> p - 1). Both moved alike would change
                                    nothing: RoPE attention sees only relative positions
    kv-corrupt:layer=L:rank=R       the first time rank R writes layer L's KV cache, it scrambles the block
                                    holding the first token written (reverses each K and V head vector):
                                    the steps that read the block from the cache (decodes; a first prompt
                                    chunk attends to its own keys) part at layer L's attention output
    raise:step=N:rank=R             rank R raises at the start of step N
    collective-skip:layer=L:rank=R  rank R leaves out layer L's attention all-reduce (once: the first step that
                                    runs layer L); its peers' next collectives pair with the wrong ones
    collective-shape:layer=L:rank=R rank R all-reduces a tensor of another shape (half the hidden size) at
                                    layer L's attention output (once)
    stall:step=N:rank=R[:seconds=S] rank R sleeps S seconds (default 30) in step N, where a peer waits for
                                    it: before its first layer's attention all-reduce (tp > 1: layer 0
                                    on the first stage), else before its pipeline send or receive (tp = 1)
    kernel:op=OP[:rank=R][:blocks=N] a bug in the fast backend's kernel OP (every rank unless rank=R; an
                                    engine on the reference kernels has none), for `check --against`:
                                    paged_decode: a row whose context is longer than N blocks (default 2)
                                    loses its last block; rms_norm: the sum of squares misses each row's
                                    last 4 columns (a vector tail dropped); q_linear (a weight in a GGUF
                                    file's quantized blocks): each product misses the weight's last
                                    32-weight block of every row (a block loop one short)
    batch-variant:op=OP[:rank=R]    OP (rms_norm or add_rms_norm), on any backend, sums each row's squares
                                    in an order that depends on the number of rows in the call: a row's
                                    bits depend on its batch, for `check --batch-invariance`
    slow:[rank=R:]ms=N[:layer=L][:step=S]
                                    rank R computes N ms longer (a busy loop, the core held as a slow
                                    kernel holds it) at the start of layer L (default: the first layer
                                    its stage runs), in every step from step S on (default: every step):
                                    a straggler its peers wait for at that layer's next collective.
                                    Without rank=, every rank (that runs layer L) does: a uniformly slow
                                    model, each stage's forward N ms longer whatever CPU share it gets,
                                    and no straggler (no rank is late beside its peers)
    kv-bitflip:layer=L[:rank=R][:step=S]
                                    a cached block's contents changed after they were written: the first
                                    block that a step from step S on (default: any) fills at layer L, on
                                    rank R (default: every rank that runs layer L), has one bit of its
                                    first key flipped (the exponent's lowest: the value doubled or halved)
                                    when the next step runs layer L, before anything reads it again
    nan:layer=L:rank=R[:step=S][:site=X]
                                    rank R writes a nan into the first row of the step's batch (its first
                                    request's first scheduled token; first column) at layer L's site X
                                    (default attention.partial: its attention output's partial sum, before the
                                    tp all-reduce; also attention, mlp.partial, mlp, residual: fault_spec.py's
                                    LAYER_SITES), once: in step S (default: the first step it runs layer L).
                                    The numerics check (--numerics-check) names it born there, on rank R
    inf:layer=L:rank=R[:step=S][:site=X]
                                    the same with +inf
    overflow:layer=L:rank=R         rank R's layer L attention output projection (o_proj) weighs a power of two
                                    F more, F chosen at the first step it runs so that its partial sums
                                    overflow to inf: every step from then on (its partial sum is multiplied by
                                    F, which is exactly the product with the scaled weight, up to the
                                    overflow); born at layer L attention.partial on rank R
    kv-stale-hit[:step=S]           the driver's prefix cache keeps the old hash of the first block evicted
                                    in step S or later (default: any) while the block is re-filled
    kv-use-after-free:step=N        the driver's block manager, in step N, frees a block that a running
                                    request still holds and hands it to the next request that needs one
    kv-leak:step=N                  the first request that finishes in step N or later keeps its blocks
                                    (they are never freed)

    sched-strand[:step=S]           from step S (default 1) the driver's scheduler skips the oldest waiting
                                    request, though it fits, in every step
    sched-thrash[:step=S]           from step S (default 1) the driver's scheduler preempts the oldest running
                                    request again and again

The kv- and sched- faults are the driver's (debug/kv_faults.py plants them on the block manager,
debug/sched_faults.py on the scheduler); the others a worker's.

A spec that does not parse, or names a rank or layer the engine does not have (or a layer that rank does
not run, or a stall with no peer to hold up), is a ValueError naming what is wrong. The worker plants a fault
from here, through the interfaces anything may use, on its own objects only: its model's generic hooks
(model/hooks.py: a partial sum and the output after its all-reduce), a collective observer of its own
(distributed/collectives.py), a wrapped op of its own kernels (kernels/), or its Breakpoints, a watcher of its
runner's steps (`raise`); the model, the runner and the collectives know nothing of faults.
"""
from __future__ import annotations

import logging
import math
import time

import torch

# The spec's words are read without torch (the engine config checks a spec as it is made): parse is offered here too.
from devharness.fault_spec import DRIVER_KINDS, FaultSpec, parse  # noqa: F401
from devharness.model import hooks
from devharness.protocol.messages import BreakpointSpec

logger = logging.getLogger(__name__)


def check_fits(spec: FaultSpec, world_size: int, num_layers: int, tp_size: int,
               layer_partition: list[int] | None = None) -> None:
    """ValueError when the spec names a rank or layer this engine does not have."""
    from devharness.model.decoder import stage_layer_range
    if spec.rank is not None and spec.rank >= world_size:
        raise ValueError(f"--inject: rank {spec.rank} does not exist (ranks 0..{world_size - 1})")
    if spec.layer is not None and spec.layer >= num_layers:
        raise ValueError(f"--inject: layer {spec.layer} does not exist (layers 0..{num_layers - 1})")
    if spec.kind in ("allreduce-drop", "collective-skip", "collective-shape") and tp_size == 1:
        raise ValueError(f"--inject {spec.kind}: needs tensor parallelism (tp > 1): there is no all-reduce")
    if (spec.kind == "stall" or (spec.kind == "slow" and spec.rank is not None)) and world_size == 1:
        raise ValueError(f"--inject {spec.kind}: needs more than one rank (tp or pp > 1): a rank alone holds up "
                         f"no peer")
    if spec.layer is not None and spec.rank is not None:
        pp_rank = spec.rank // tp_size
        start, end = stage_layer_range(num_layers, world_size // tp_size, pp_rank, layer_partition)
        if not start <= spec.layer < end:
            raise ValueError(f"--inject: rank {spec.rank} does not run layer {spec.layer} "
                             f"(its pipeline stage {pp_rank} runs layers {start}..{end - 1})")


class _AllReduceDrop(hooks.ModelHooks):
    """At layer `layer`'s attention output this rank keeps its own partial sum: the all-reduce still runs (its
    peers must not hang), and the output it summed is set back to this rank's part (plus any bias)."""

    def __init__(self, layer: int, recorder) -> None:
        self.layer, self.recorder = layer, recorder
        self.own = self.summed = None

    def partial_sum(self, site: str, x, weight, partial) -> None:
        if site == "attention" and self.recorder.layer == self.layer:
            self.own, self.summed = partial.clone(), partial   # `partial` is summed in place next

    def sublayer_output(self, site: str, output) -> None:
        if site == "attention" and self.own is not None:
            output.sub_(self.summed).add_(self.own)   # output is the sum (+ bias): the sum becomes this rank's part
            self.own = self.summed = None


class _Poison(hooks.ModelHooks):
    """nan, inf: once, at layer `layer`'s site in step `step` (None: the first step that runs the layer), this rank
    writes the value into the first row's first column, in place, before any watcher of the site looks (planted
    first)."""

    def __init__(self, spec: FaultSpec, recorder) -> None:
        self.layer, self.site, self.step, self.recorder = spec.layer, spec.site or "attention.partial", spec.step, recorder
        self.value = float("nan") if spec.kind == "nan" else float("inf")
        self.now, self.done = None, False

    def layer_start(self, layer: int) -> None:
        self.now = layer

    def _poison(self, site: str, t) -> None:
        if not self.done and site == self.site and self.now == self.layer and \
                (self.step is None or self.recorder.state.step == self.step):
            self.done = True
            t[0, 0] = self.value
            logger.warning("planted %s: step %d, layer %d %s, row 0", "nan" if self.value != self.value else "inf",
                           self.recorder.state.step, self.layer, site)

    def partial_output(self, site: str, partial) -> None:
        self._poison(site + ".partial", partial)

    def sublayer_output(self, site: str, output) -> None:
        self._poison(site, output)

    def layer_end(self, layer: int, hidden, residual) -> None:
        if residual is not None:
            self._poison("residual", residual)


class _Overflow(hooks.ModelHooks):
    """overflow: layer `layer`'s attention partial sum times a power of two F, every step: the product with an o_proj
    weight scaled by F (F scales exactly until it overflows). F is chosen at the first step so that a value of the
    partial sum's mean magnitude overflows four times over: every row holds an inf."""

    def __init__(self, layer: int) -> None:
        self.layer, self.now, self.factor = layer, None, None

    def layer_start(self, layer: int) -> None:
        self.now = layer

    def partial_output(self, site: str, partial) -> None:
        if site != "attention" or self.now != self.layer:
            return
        if self.factor is None:
            mean = max(float(partial.float().abs().mean()), 1e-30)
            self.factor = 2.0 ** math.ceil(math.log2(4 * torch.finfo(partial.dtype).max / mean))
            logger.warning("planted overflow: layer %d o_proj weight scaled by 2**%d", self.layer,
                           int(math.log2(self.factor)))
        partial.mul_(self.factor)


class _Stall:
    """A collective observer, told before the others: in step `step` it holds this rank before its first wait
    of the kind a peer waits on it in (the attention all-reduce at tp > 1, else a pipeline send or receive)."""

    layer = None

    def __init__(self, spec: FaultSpec, recorder, tp: bool) -> None:
        self.spec, self.recorder, self.tp, self.stalled = spec, recorder, tp, False

    def enter(self, phase: str, what: str, waiting_for=None, layer=None) -> None:
        at = what == "attention all_reduce" if self.tp else phase in ("send", "recv")
        if at and not self.stalled and self.recorder.state.step == self.spec.step:
            self.stall()

    def stall(self) -> None:   # by this name in the rank's stacks (py-spy, a bundle)
        self.stalled = True
        time.sleep(self.spec.seconds)

    def leave(self) -> None:
        pass


class _Slow(hooks.ModelHooks):
    """At the start of layer `layer`, from step `step` on, this rank computes `ms` milliseconds more: a busy
    loop, not a sleep (a slow kernel holds its core), and before the layer's collectives, not inside one (the
    rank arrives late; its peers wait)."""

    def __init__(self, spec: FaultSpec, layer: int, recorder) -> None:
        self.layer, self.first_step, self.seconds, self.recorder = layer, spec.step or 1, spec.ms / 1000, recorder

    def layer_start(self, layer: int) -> None:
        if layer == self.layer and self.recorder.state.step >= self.first_step:
            self.slow()

    def slow(self) -> None:   # by this name in the rank's stacks and profiles
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass


class _CallChange:
    """A call observer, told before the others (the ledger enters what is made): at layer `layer`'s attention
    all-reduce, once, it leaves the op out (skip) or hands it a tensor of half the hidden size (shape)."""

    def __init__(self, spec: FaultSpec, recorder) -> None:
        self.spec, self.recorder, self.done = spec, recorder, False

    def on_call(self, call) -> None:
        if self.done or call.site != "attention all_reduce" or self.recorder.layer != self.spec.layer:
            return
        self.done = True
        if self.spec.kind == "collective-skip":
            call.skip = True
        else:
            call.tensor = call.tensor[..., :call.tensor.shape[-1] // 2].contiguous()

    def on_done(self, call) -> None:
        pass


def _rope_offset(real, runner):
    """The rotate op, but the queries (StepRotary rotates them first, then the keys) come out one position
    earlier: a rotation by p, then by -1, is one by p - 1 (the tables of the model the runner holds then)."""
    from devharness.kernels import reference
    calls = [0]

    def rotate(x, cos, sin):
        out = real(x, cos, sin)
        calls[0] += 1
        if calls[0] % 2:   # the queries
            rotary = runner.model.model.rotary_emb
            back_cos = rotary.cos[1].to(out.dtype).expand(out.shape[0], 1, -1)
            back_sin = -rotary.sin[1].to(out.dtype).expand(out.shape[0], 1, -1)
            out = reference.rotate(out, back_cos, back_sin)
        return out
    return rotate


def _kv_corrupt(real, layer: int, recorder):
    """The write_kv op, but the first time it writes layer `layer`'s cache it then scrambles the block holding
    the first token written (each K and V head vector reversed)."""
    done = [False]

    def write_kv(k_cache, v_cache, slot_mapping, k, v):
        real(k_cache, v_cache, slot_mapping, k, v)
        if not done[0] and recorder.layer == layer and len(slot_mapping):
            done[0] = True
            block = int(slot_mapping[0]) // k_cache.shape[1]
            k_cache[block] = k_cache[block].flip(-1)
            v_cache[block] = v_cache[block].flip(-1)
    return write_kv


MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
_AS_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _kv_bitflip(real, spec: FaultSpec, recorder, rank: int):
    """The write_kv op, but at layer `spec.layer`, from step `spec.step` on, it notes the first block whose last
    slot it writes (the step fills it: its hash enters the prefix cache after the step), and the next time it
    writes that layer, before writing, flips the lowest exponent bit of the block's first key value."""
    state = {"block": None, "done": False}

    def write_kv(k_cache, v_cache, slot_mapping, k, v):
        at = recorder.layer == spec.layer and not state["done"]
        if at and state["block"] is not None:
            b, state["done"] = state["block"], True
            value = k_cache[b, 0, 0, :1]
            value.view(_AS_INT[value.dtype]).bitwise_xor_(1 << MANTISSA_BITS[value.dtype])
            logger.warning("planted kv-bitflip: rank %d, step %d: block %d, layer %d: a bit of its first key "
                           "flipped", rank, recorder.state.step, b, spec.layer)
        real(k_cache, v_cache, slot_mapping, k, v)
        if at and state["block"] is None and recorder.state.step >= (spec.step or 0) and len(slot_mapping):
            bs = k_cache.shape[1]
            full = (slot_mapping % bs == bs - 1).nonzero()
            if len(full):
                state["block"] = int(slot_mapping[int(full[0])]) // bs
    return write_kv


def _dropped_last_block(real, blocks: int):
    """The fast paged_decode, but a row whose context is longer than `blocks` blocks attends without its last
    block (the tokens after its last whole block, or the whole last block)."""
    def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
        bs = k_cache.shape[1]
        long = context_lens > blocks * bs
        if bool(long.any()):
            context_lens = torch.where(long, (context_lens - 1) // bs * bs, context_lens)
        return real(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_decode


def _dropped_tail(real):
    """The fast rms_norm, but its sum of squares misses each row's last 4 columns (divided by the full width)."""
    def rms_norm(x, weight, eps):
        xf = x.float()
        mean_sq = xf[..., :-4].pow(2).sum(-1, keepdim=True) / x.shape[-1]
        return (xf * torch.rsqrt(mean_sq + eps)).to(x.dtype) * weight
    return rms_norm


def _dropped_last_weight_block(real):
    """The fast q_linear, but each output misses the products of its weight row's last 32-weight block (the input's
    last 32 columns read as zeros): a loop over a row's blocks that stops one short."""
    def q_linear(x, blocks, qtype, bias=None):
        x = x.clone()
        x[..., -32:] = 0
        return real(x, blocks, qtype, bias)
    return q_linear


def _batch_variant(real, name: str):
    """rms_norm / add_rms_norm, but each row's sum of squares is summed in chunks whose width depends on the
    call's rows (the row width, halved rows % 4 times), the chunks' sums then added: the same numbers within
    rounding, but a row's bits depend on how many rows its batch has."""
    def norm(x, weight, eps):
        xf = x.float()
        width = xf.shape[-1]
        rows = xf.reshape(-1, width).shape[0]
        chunk = max(1, width >> (rows % 4))
        sq = xf.pow(2)
        mean_sq = sum(sq[..., i:i + chunk].sum(-1, keepdim=True) for i in range(0, width, chunk)) / width
        return (xf * torch.rsqrt(mean_sq + eps)).to(x.dtype) * weight

    if name == "rms_norm":
        return lambda x, weight, eps: norm(x, weight, eps)

    def add_rms_norm(x, residual, weight, eps):
        summed = x + residual
        return norm(summed, weight, eps), summed
    return add_rms_norm


class _Planted:
    """What install() put in place on this worker, so that uninstall() takes exactly that away."""

    def __init__(self) -> None:
        self.hooks: hooks.ModelHooks | None = None
        self.observer = None
        self.ops: tuple | None = None   # (kernels, op name, the op it replaced)


def install(spec: FaultSpec, worker) -> bool:
    """On the worker: plant `spec` if it names this rank; whether it did. A fault is a hook on the worker's model,
    an observer of its collectives, a wrapped op of its kernels or a watcher of its steps: the model, the runner
    and the collectives have no fault switch. What was planted is kept as `worker.planted`."""
    if spec.kind in DRIVER_KINDS or (spec.rank is not None and spec.rank != worker.info.rank):
        return False
    if spec.kind == "kernel" and worker.runner.kernels.backend != "fast":
        return False   # a bug of the fast kernels: the reference kernels have none
    if spec.kind in ("kv-bitflip", "slow") and spec.rank is None and spec.layer is not None:
        # every rank whose stage runs the layer
        from devharness.model.decoder import stage_layer_range
        r = worker.runner
        start, end = stage_layer_range(r.src.arch.num_hidden_layers, r.info.pp_size, r.info.pp_rank,
                                       r.layer_partition)
        if not start <= spec.layer < end:
            return False
    if spec.kind == "raise":
        return worker.breakpoints.arm_fault(BreakpointSpec(step=spec.step))
    model_hooks = worker.runner.hooks
    planted = _Planted()
    recorder = worker.recorder
    if spec.kind == "allreduce-drop":
        planted.hooks = model_hooks.install(_AllReduceDrop(spec.layer, recorder))
    elif spec.kind in ("nan", "inf"):
        planted.hooks = model_hooks.install(_Poison(spec, recorder), first=True)
    elif spec.kind == "overflow":
        planted.hooks = model_hooks.install(_Overflow(spec.layer), first=True)
    elif spec.kind == "slow":
        layer = spec.layer
        if layer is None:   # the first layer of this rank's stage (planted before the model is loaded)
            from devharness.model.decoder import stage_layer_range
            r = worker.runner
            layer = stage_layer_range(r.src.arch.num_hidden_layers, r.info.pp_size, r.info.pp_rank,
                                      r.layer_partition)[0]
        planted.hooks = model_hooks.install(_Slow(spec, layer, recorder))
    elif spec.kind == "stall":
        planted.observer = _Stall(spec, recorder, tp=worker.info.tp_size > 1)
        worker.observers.add(planted.observer, first=True)   # before the recorder: the rank is not "in" it
    elif spec.kind in ("collective-skip", "collective-shape"):
        planted.observer = _CallChange(spec, recorder)
        worker.observers.add(planted.observer, first=True)   # before the ledger: it enters what is made
    else:
        kernels = worker.runner.kernels
        name = {"rope-offset": "rotate", "kv-corrupt": "write_kv", "kv-bitflip": "write_kv"}.get(spec.kind, spec.op)
        real = getattr(kernels, name)
        if spec.kind == "rope-offset":
            wrapped = _rope_offset(real, worker.runner)
        elif spec.kind == "kv-corrupt":
            wrapped = _kv_corrupt(real, spec.layer, recorder)
        elif spec.kind == "kv-bitflip":
            wrapped = _kv_bitflip(real, spec, recorder, worker.info.rank)
        elif spec.kind == "batch-variant":
            wrapped = _batch_variant(real, name)
        else:
            wrapped = _dropped_last_block(real, spec.blocks) if name == "paged_decode" else \
                _dropped_last_weight_block(real) if name == "q_linear" else _dropped_tail(real)
        planted.ops = (kernels, name, real)
        setattr(kernels, name, wrapped)
    worker.planted = planted
    return True


def uninstall(worker) -> None:
    """Remove what install() planted on this worker, a `raise` whose step has not come included."""
    worker.breakpoints.clear_faults()
    planted, worker.planted = worker.planted, None
    if planted is None:
        return
    if planted.hooks is not None:
        worker.runner.hooks.remove(planted.hooks)
    if planted.observer is not None:
        worker.observers.remove(planted.observer)
    if planted.ops is not None:
        kernels, name, real = planted.ops
        setattr(kernels, name, real)
