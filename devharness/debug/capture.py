"""Activation capture for site-by-site comparison (`devharness check`).

Armed on a worker, model hooks keep, for every forward until taken, each of this worker's decoder layers'
attention output and MLP output (after their TP all-reduce) and the residual stream after the layer. At
tp > 1 a rank also keeps its own partial sums (its o_proj / down_proj share before the all-reduce); a tp=1
worker armed with `split` computes the partial sums each of `split` TP shards would produce from its
slice of heads / intermediate columns, so the driver can name the rank whose contribution parts.

Armed by op (`ops`), it wraps instead every op of the worker's kernels (the registry's names) and keeps each
call's output, split into each request's rows with the token position of its first row, and names where the
call ran: "embedding" (before the first layer: a lookup in quantized blocks), the layer and its site ("attention"
up to the attention's output, then "mlp"), "final" (the last norm) or "head" (the LM head and sampling, whose rows
are the sampled rows). It learns a step's rows by wrapping the runner's prepare_inputs. Kernel and batch checks
compare these, op by op. With `alone`, a kept request's rows of a call that held others too run again through the
op by themselves (its row arguments sliced): whether that op, on those very inputs, gives those rows other bits
inside a batch.

Either way it also keeps each step's logits of the sampled rows (site "logits", layer -1), computed from the
hidden states the runner samples from (its head watchers), through the model's own LM head: on the greedy path
at tp=1 the engine never writes the logits, and `check` weighs a flipped token by their top-1/top-2 margin.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from devharness.distributed.parallel_state import get_parallel_info
from devharness.protocol.messages import CapturedTensor
from devharness.model.hooks import HookSet, ModelHooks


class _Capture(ModelHooks):
    def __init__(self) -> None:
        self.kept: list[tuple[int, int, str, int | None, torch.Tensor]] = []
        self.step = 0
        self.layer = 0
        self.own_shard: int | None = None   # at tp > 1: this rank's TP rank, whose partial sums it keeps
        self.split: int | None = None       # at tp = 1: how many shards' partial sums to compute
        self.sampled = 0                    # steps that sampled a token since armed

    def _keep(self, site: str, t: torch.Tensor, shard: int | None = None) -> None:
        self.kept.append((self.step, self.layer, site, shard, t.detach().float().cpu().clone()))

    def layer_start(self, layer: int) -> None:
        self.layer = layer

    def partial_sum(self, site: str, x: torch.Tensor, weight: torch.Tensor, partial: torch.Tensor) -> None:
        if self.own_shard is not None:
            self._keep(site, partial, self.own_shard)
        if self.split is None:
            return
        # RowParallelLinear gives TP rank r the r-th contiguous slice of the input columns.
        cols = x.shape[-1] // self.split
        for shard in range(self.split):
            part = slice(shard * cols, (shard + 1) * cols)
            self._keep(site, F.linear(x[..., part], weight[:, part]), shard)

    def sublayer_output(self, site: str, output: torch.Tensor) -> None:
        self._keep(site, output)

    def layer_end(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        self._keep("residual", hidden if residual is None else hidden + residual)

    def layers_done(self) -> None:
        self.step += 1

    def head(self, logits: torch.Tensor) -> None:
        """The logits of a step's sampled rows, under the count of steps that sampled before it (a prompt chunk
        that samples nothing is a step of the sites but no token's)."""
        self.kept.append((self.sampled, -1, "logits", None, logits.detach().float().cpu().clone()))
        self.sampled += 1


class _OpCapture(ModelHooks):
    """Every op call of one runner's kernels, its output split by request (see the module docstring)."""

    HEAD_OPS = ("linear", "linear_argmax", "argmax", "q_linear", "q_linear_argmax")

    def __init__(self, runner, requests: list[str] | None, alone: bool = False) -> None:
        from devharness.kernels import OPS
        self.row_args = {name: op.rows_args for name, op in OPS.items()}
        self.alone = alone
        self.runner, self.kernels = runner, runner.kernels
        self.requests = None if requests is None else set(requests)
        self.kept: list[CapturedTensor] = []
        self.step = -1
        self.inputs = None
        self.layer, self.site = -1, "attention"
        self.calls: dict[tuple, int] = {}
        self.real = {name: getattr(self.kernels, name) for name in OPS}
        self.wrappers = {name: self._wrap(name, real) for name, real in self.real.items()}
        for name, wrapper in self.wrappers.items():
            setattr(self.kernels, name, wrapper)
        self.prepare = runner.prepare_inputs
        runner.prepare_inputs = self._prepare_inputs

    def remove(self) -> None:
        for name, wrapper in self.wrappers.items():
            if getattr(self.kernels, name) is wrapper:   # a fault planted since wraps it: leave that alone
                setattr(self.kernels, name, self.real[name])
        if self.runner.__dict__.get("prepare_inputs") == self._prepare_inputs:
            del self.runner.prepare_inputs

    def _prepare_inputs(self, so):
        self.inputs = self.prepare(so)
        self.step += 1
        self.layer, self.site = -1, "embedding"   # until the first layer starts (a lookup op: q_embedding)
        self.calls.clear()
        return self.inputs

    # Where the next op runs: the model's hooks.
    def layer_start(self, layer: int) -> None:
        self.layer, self.site = layer, "attention"

    def sublayer_output(self, site: str, output) -> None:
        if site == "attention":
            self.site = "mlp"

    def layers_done(self) -> None:
        self.layer, self.site = -1, "final"

    def head(self, logits: torch.Tensor) -> None:
        """The step's logits, one row per sampled request (sample_req_ids' order), at its sampled row's position."""
        inp = self.inputs
        rows = logits.detach().float().cpu()
        for i, rid in enumerate(inp.sample_req_ids):
            if rid not in inp.req_rows or (self.requests is not None and rid not in self.requests):
                continue
            start, n, position = inp.req_rows[rid]
            t = rows[i:i + 1].contiguous()
            self.kept.append(CapturedTensor(self.step, -1, "logits", None, list(t.shape), t.numpy().tobytes(),
                                            "logits", 0, rid, position + n - 1))

    def _wrap(self, name: str, real):
        def op(*args):
            out = real(*args)
            if out is not None and self.inputs is not None:
                self._keep(name, out, real, args)
            return out
        op.__name__ = f"captured_{name}"
        return op

    def _alone_diff(self, name: str, real, args, first: int, n: int, rows: torch.Tensor) -> float | None:
        """Rows first..first+n of this call run through the op by themselves: their relative difference."""
        total = rows.shape[0]
        if n == total or not self.row_args[name]:
            return None
        sliced = [a[first:first + n] if i in self.row_args[name] and isinstance(a, torch.Tensor)
                  and a.shape[0] == total else a for i, a in enumerate(args)]
        out = real(*sliced)
        outs = out if isinstance(out, tuple) else (out,)
        alone = torch.cat([o.detach().reshape(o.shape[0], -1).float() for o in outs], dim=-1).cpu()
        batched = rows[first:first + n]
        if torch.equal(alone, batched):
            return 0.0
        return float((alone - batched).abs().max()) / max(float(batched.abs().max()), 1e-30)

    def _keep(self, name: str, out, real=None, args=()) -> None:
        site = self.site
        if site == "final" and name in self.HEAD_OPS:
            site = self.site = "head"
        call = self.calls.get((self.layer, site, name), 0)
        self.calls[(self.layer, site, name)] = call + 1
        outs = out if isinstance(out, tuple) else (out,)
        rows = torch.cat([o.detach().reshape(o.shape[0], -1).float() for o in outs], dim=-1).cpu()
        inp = self.inputs
        if site == "head":   # one row per sampled request, in sample_req_ids' order
            spans = [(rid, i, 1, inp.req_rows[rid][2] + inp.req_rows[rid][1] - 1)
                     for i, rid in enumerate(inp.sample_req_ids) if rid in inp.req_rows][:rows.shape[0]]
        else:
            offset = 0   # the token row of the call's first row: attention calls take a group or a chunk
            if name == "paged_decode":
                offset = inp.meta.decode_groups[call % max(1, len(inp.meta.decode_groups))].token_start
            elif name == "prefill_attention":
                offset = inp.meta.prefills[call % max(1, len(inp.meta.prefills))].token_start
            spans = []
            for rid, (start, n, position) in inp.req_rows.items():
                lo, hi = max(start, offset), min(start + n, offset + rows.shape[0])
                if lo < hi:
                    spans.append((rid, lo - offset, hi - lo, position + lo - start))
        for rid, first, n, position in spans:
            if self.requests is not None and rid not in self.requests:
                continue
            t = rows[first:first + n].contiguous()
            alone = self._alone_diff(name, real, args, first, n, rows) if self.alone else None
            self.kept.append(CapturedTensor(self.step, self.layer, site, None, list(t.shape), t.numpy().tobytes(),
                                            name, call, rid, position, alone))


class Capture:
    """One worker's capture: armed on the HookSet of that worker's model (and, by op, on its runner's kernels),
    never on another engine's."""

    def __init__(self, hooks: HookSet, runner) -> None:
        self.hooks, self.runner = hooks, runner
        self.sites = _Capture()
        self.ops: _OpCapture | None = None

    def _head(self, rows: torch.Tensor, inp) -> None:
        """A head watcher: the sampled rows' logits through the model's LM head (under tp it gathers: every rank
        of the last stage calls it), kept by the armed capture. The op capture does not keep these ops' calls."""
        if not rows.shape[0]:   # a prompt chunk that samples nothing (alike on every rank)
            return
        ops = self.ops
        if ops is not None:
            saved, ops.inputs = ops.inputs, None   # its wrapped ops keep nothing while inputs is None
            try:
                logits = self.runner.model.compute_logits(rows)
            finally:
                ops.inputs = saved
            ops.head(logits)
        else:
            self.sites.head(self.runner.model.compute_logits(rows))

    def arm(self, split: int | None = None, ops: bool = False, requests: list[str] | None = None,
            alone: bool = False) -> None:
        """Keep every site of every forward from now until take(); see the module docstring for `split`. With
        `ops`, keep every op's output of the runner's kernels instead (of `requests` only, where given)."""
        self._disarm()
        self.runner.head_watchers = (*self.runner.head_watchers, self._head)
        if ops:
            self.ops = _OpCapture(self.runner, requests, alone)
            self.hooks.install(self.ops)
            return
        info = get_parallel_info()
        c = self.sites
        c.kept.clear()
        c.step = c.sampled = 0
        c.own_shard = info.tp_rank if info.tp_size > 1 else None
        c.split = split if info.tp_size == 1 and split is not None and split > 1 else None
        self.hooks.install(c)

    def _disarm(self) -> list[CapturedTensor]:
        c = self.sites
        self.hooks.remove(c)
        self.runner.head_watchers = tuple(w for w in self.runner.head_watchers if w != self._head)
        out = [CapturedTensor(step, layer, site, shard, list(t.shape), t.numpy().tobytes())
               for step, layer, site, shard, t in c.kept]
        c.kept.clear()
        if self.ops is not None:
            self.hooks.remove(self.ops)
            self.ops.remove()
            out, self.ops = self.ops.kept, None
        return out

    def take(self) -> list[CapturedTensor]:
        """What was captured since arm(), and disarm."""
        return self._disarm()
