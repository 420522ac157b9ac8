"""A step of a few decodes as recorded kernel calls: the decoder layers' Python runs at a step of a shape
(its rows) while the kernels record the C calls it makes (Kernels.capture), and later steps of that shape make the
same calls again without it (a replay), layer by layer inside the model's own layer loop (decoder.py), whose
hooks still run around each layer. The same calls with the same arguments: the same bits as the Python.

A replay reads the step's tensors from copies the capture ran on (cos/sin, the slots, the block tables padded to
the longest context the model takes, the context lengths: `Shape.bind` refills them each step) and each layer's
input from the tensor the capture handed it (the previous layer's output, which the previous replay rewrote, or a
copy of what came in). Steps run as Python wherever a replay could not stand for them: a step with a prompt chunk or
several decode groups, more than MAX_ROWS rows, tensor parallelism (a collective inside a layer), a debugger
tracing the thread (sys.gettrace: a breakpoint in a layer's Python then stops there), a hook inside a layer (a
projection's partial sum or output), a wrapped op or a watched dispatcher (Kernels.records), a weight or a cache
changed since the capture (captured again), or a capture refused (a torch op computed inside a layer: a bias, an
op's reference; a `breakpoint()` in a layer's code, which then stops at every step; said once in the log, and the
shape then always runs as Python)."""
from __future__ import annotations

import logging
import sys

import torch

from devharness.model.attention import AttentionMetadata, DecodeGroup

logger = logging.getLogger(__name__)

MAX_ROWS = 8   # a single stream's and a few streams' steps: where the Python costs as much as the kernels
# Steps of a shape that run as Python before it is captured: a capture costs about three steps' Python (torch's
# profiler over it, the checks), which a shape seen only a few times (a batch's tail) would not win back.
CAPTURE_AFTER = 2


def _debugged() -> bool:
    """Whether a debugger traces this thread: a trace function (debugpy on Python 3.11), or a sys.monitoring
    debugger (3.12 on)."""
    if sys.gettrace() is not None:
        return True
    monitoring = getattr(sys, "monitoring", None)
    return monitoring is not None and monitoring.get_tool(monitoring.DEBUGGER_ID) is not None


class StepGraphs:
    """One model's recorded layers, by step shape."""

    def __init__(self, model):
        self.model = model
        self.shapes: dict[tuple, "Shape | None"] = {}   # None: refused (runs as Python)
        self.seen: dict[tuple, int] = {}   # steps of each shape not captured yet
        self.kernels = None

    def step(self, hidden, residual, positions, meta: AttentionMetadata, rotary) -> "Shape | None":
        """The recorded form of this step's layers (capturing it now, at the third step of its shape), bound to the
        step's tensors; None where the step runs as Python."""
        model = self.model
        kernels = model.kernels
        hooks = model.hooks
        rows = positions.shape[0]
        if rows > MAX_ROWS or meta.prefills or len(meta.decode_groups) != 1 or model.tp_size != 1 \
                or hooks.partial_sum or hooks.partial_output or hooks.sublayer_output or _debugged() \
                or getattr(rotary, "positions", None) is not positions or not kernels.records():
            return None
        group = meta.decode_groups[0]
        if group.context_lens.shape[0] != rows:
            return None
        if kernels is not self.kernels:   # another backend (set_kernels): what was recorded was its calls
            self.shapes.clear()
            self.seen.clear()
            self.kernels = kernels
        key = (rows, residual is None, hidden.dtype, torch.get_num_threads())
        shape = self.shapes.get(key, False)
        if shape is None:
            return None
        if shape is False or shape.capturing or not shape.current():   # capturing: one that raised
            seen = self.seen[key] = self.seen.get(key, 0) + 1
            if seen <= CAPTURE_AFTER:
                return None
            shape = Shape(self, key, rotary, meta)
            if not shape.covered:   # a table short of its context: the Python names the error
                return None
            self.shapes[key] = shape
        return shape if shape.bind(rotary, meta) else None


class Shape:
    """The recorded layers of steps of one shape: the step tensors they read (bound to each step's values), and per
    layer its Recording with the tensors it took in and gave out."""

    def __init__(self, graphs: StepGraphs, key: tuple, rotary, meta: AttentionMetadata):
        self.graphs, self.key, self.model = graphs, key, graphs.model
        group = meta.decode_groups[0]
        self.caches = [(m, m.k_cache, m.v_cache) for m in self.model.modules()
                       if isinstance(getattr(m, "k_cache", None), torch.Tensor)]
        block_size = self.caches[0][1].shape[1] if self.caches else 1
        width = -(-self.model.model.rotary_emb.cos.shape[0] // block_size)   # blocks of the longest context
        self.cos, self.sin = rotary.cos.clone(), rotary.sin.clone()
        self.rotary = type(rotary)(rotary.rotary, rotary.positions, (self.cos, self.sin))
        self.slots, self.lens = meta.slot_mapping.clone(), group.context_lens.clone()
        tables = group.block_tables
        # Past each step's own width, block 0 (what a replay never reads: bind() sends a step whose table does not
        # cover its context to the Python, which names the error, as it does at the capture).
        self.tables = torch.zeros(tables.shape[0], max(width, tables.shape[1]), dtype=tables.dtype,
                                  device=tables.device)
        self.tables[:, :tables.shape[1]] = tables
        self.filled, self.block_size = tables.shape[1], block_size   # filled: the columns a step's values took
        self.covered = self._covers(group.context_lens, tables.shape[1])
        self.meta = AttentionMetadata(self.slots, meta.num_decode_tokens,
                                      [DecodeGroup(group.token_start, self.tables, self.lens)], [])
        self.layers: dict[int, tuple] = {}   # index -> (Recording, hidden in, residual in, hidden out, residual out)
        self.weights: list[tuple] = []       # (tensor, version, address) of every weight the recordings read
        self.capturing, self.refused, self.again, self.failed = True, None, False, False
        self.watch = None   # the profiler over the capture (kernels.watch())

    def current(self) -> bool:
        """Whether the recordings still stand: the caches and weights they read are those they read then."""
        for attn, k, v in self.caches:
            if attn.k_cache is not k or attn.v_cache is not v:
                return False
        for t, version, ptr in self.weights:
            if t._version != version or t.data_ptr() != ptr:
                return False
        return True

    def bind(self, rotary, meta: AttentionMetadata) -> bool:
        """This step's values into the tensors the recordings read; False where they do not fit (a table wider than
        the longest context, or short of a context: the Python then runs the step, and names that error)."""
        self.failed = False
        if self.capturing:
            return True   # the capture runs on copies of this step's values
        group = meta.decode_groups[0]
        tables, width = group.block_tables, group.block_tables.shape[1]
        if width > self.tables.shape[1] or tables.dtype != self.tables.dtype \
                or not self._covers(group.context_lens, width):
            return False
        self.cos.copy_(rotary.cos)
        self.sin.copy_(rotary.sin)
        self.slots.copy_(meta.slot_mapping)
        self.lens.copy_(group.context_lens)
        self.tables[:, :width].copy_(tables)
        if width < self.filled:
            self.tables[:, width:self.filled].zero_()
        self.filled = width
        return True

    def _covers(self, lens, width: int) -> bool:
        """Whether tables `width` blocks wide hold every context of `lens` (one width for every row)."""
        return int(lens.max()) <= width * self.block_size

    def layer(self, idx: int, layer, positions, hidden, residual, meta, rotary):
        """Layer `idx` of this step: captured (the third step of the shape) or replayed; as Python where neither
        can be (after a replay that failed: the step's own meta and rotary, so that an error names what is wrong)."""
        if self.capturing:
            return self._capture(idx, layer, positions, hidden, residual)
        if not self.failed:
            rec, h_in, r_in, h_out, r_out = self.layers[idx]
            if hidden is not h_in:
                h_in.copy_(hidden)
            if residual is not r_in:
                r_in.copy_(residual)
            if rec.replay():
                return h_out, r_out
            self.failed = True   # the rest of the step as Python; captured again at the next such step
            self.graphs.shapes.pop(self.key, None)
        return layer(positions, hidden, residual, meta, rotary)

    def _capture(self, idx, layer, positions, hidden, residual):
        if self.refused is not None:
            return layer(positions, hidden, residual, self.meta, self.rotary)
        inputs = [hidden, residual, self.cos, self.sin, self.slots, self.tables, self.lens]
        lasting = [*layer.parameters(), *layer.buffers(),
                   *(t for m in layer.modules() for t in (getattr(m, "k_cache", None), getattr(m, "v_cache", None))
                     if isinstance(t, torch.Tensor))]
        if self.watch is None:   # the capture's torch ops, seen by the profiler: done() reads them
            self.watch = self.model.kernels.watch()
            self.watch.__enter__()
        hook, fired = sys.breakpointhook, []

        def breakpointhook(*args, **kwargs):   # a breakpoint() in the layer's code: it stops on every step, as Python
            fired.append(True)
            return hook(*args, **kwargs)
        sys.breakpointhook = breakpointhook
        try:
            with self.model.kernels.capture(str(idx)) as rec:
                out = layer(positions, hidden, residual, self.meta, self.rotary)
        finally:
            sys.breakpointhook = hook
        if fired:
            rec.refused, rec.again = "a breakpoint() in it", False
        if rec.seal(inputs, lasting, out):
            self.layers[idx] = (rec, hidden, residual, *out)
            self.weights += [(t, t._version, t.data_ptr()) for t in layer.parameters()]
        else:
            self.refused, self.again = f"layer {idx}: {rec.refused}", rec.again
        return out

    def done(self, hidden, residual, finished: bool = True):
        """After the last layer, or where a layer raised (finished False): the capture ends (the shape is replayed from
        the next step on; or captured again at the next step where a weight was being prepared or a layer raised; or
        refused, said once); the outputs as the model hands them on (copies where a later stage takes the
        recordings' own, which the next step rewrites)."""
        if self.capturing:
            self.capturing = False
            if self.watch is not None:
                self.watch.__exit__(None, None, None)
                computed = self.watch.computed() if finished else {}
                self.watch = None
                if computed and self.refused is None:
                    idx, ops = next(iter(computed.items()))
                    self.refused = f"layer {idx}: torch computed in it ({', '.join(sorted(set(ops)))})"
            if self.again or not finished:
                self.graphs.shapes.pop(self.key, None)
            elif self.refused is not None:
                self.graphs.shapes[self.key] = None
                logger.info("steps of %d decodes run as Python: %s", self.key[0], self.refused)
            return hidden, residual
        if self.model.last or self.failed or not finished:
            return hidden, residual
        return hidden.clone(), residual.clone()
