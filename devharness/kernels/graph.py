"""Recorded kernel calls: a block of the model's Python run once while the C calls its ops make are recorded
(capture), then those calls made again, without the Python around them (replay). The CPU's form of what CUDA graphs
are to a GPU engine: the Python stays the one description of the model (it runs at every capture, and wherever
something watches it), a replay makes the same C calls with the same arguments, so it gives the same bits.

A replay reads and writes the memory the capture did: the tensors the wrappers of cpu.py allocated during the
capture (kept alive here, written again by every replay), the inputs the caller names (it copies each step's
values into them before a replay) and the tensors that outlive a step (weights, their packs, the KV caches). A
capture stands for its block only where that holds for every pointer a recorded call took (Recording.seal: a tensor
a torch op made and handed to a C call holds none of that memory) and where nothing but the recorded calls
computed: torch's profiler over the capture (Watch; version counters cannot tell, since the forward's tensors are
inference tensors, which keep none) names any other torch op that ran inside it, in the ops' own Python too. A
capture that made a pack or a repack (the first use of a weight) is not sealed either: the next one is. Anything
else (a bias added by torch, an op's reference run where its kernel declined, a collective) leaves the block to run
as Python."""
from __future__ import annotations

import bisect
import ctypes
import os
import threading

import torch

from devharness.kernels import cpu

# Calls that ask the library something and compute nothing: made at capture, not recorded.
QUERIES = frozenset({"q_repack_bytes", "q_prepack_bytes", "q_tiled_rows", "q_prep_rows", "linear_panel"})
# Calls that prepare a weight (a pack, a repack): a capture that makes one is not sealed.
PREPARES = frozenset({"q_repack_f32", "q_prepack_f32", "pack_linear_f32"})


class Recording:
    """The C calls one block made (capture()), with what they need to be made again (seal, replay)."""

    def __init__(self):
        self.calls: list[tuple] = []     # (the ctypes function, its arguments, whether it returns a code)
        self.kept: list[torch.Tensor] = []   # what the wrappers allocated meanwhile
        self.refused: str | None = None   # why it cannot be replayed, once seen
        self.again = False   # refused for now only: it prepared a weight, which the next capture finds ready
        self._thread = threading.get_ident()

    def seal(self, inputs, lasting, outputs) -> bool:
        """Whether the recorded calls can stand for the block, as far as their memory tells: every pointer they took
        lies in a kept tensor, one of `inputs` (tensors the caller refills before each replay; None entries are
        skipped) or of `lasting` (tensors that outlive the step: the layer's weights and caches), and `outputs` are
        kept tensors or inputs. (That no torch op computed inside the block, a Watch over the capture tells.) Drops
        the kept tensors where not (refused names why)."""
        if self.refused is None:
            self.refused = self._check([t for t in inputs if t is not None], lasting, outputs)
        if self.refused is not None:
            self.calls, self.kept = [], []
        return self.refused is None

    def _check(self, inputs, lasting, outputs) -> str | None:
        extents = _Extents((*self.kept, *inputs, *lasting, *cpu_lasting()))
        for fn, args, _ in self.calls:
            for i, kind in enumerate(fn.argtypes):
                if kind is ctypes.c_void_p and args[i] is not None and args[i] not in extents:
                    return f"{fn.__name__} took memory no kept, input or lasting tensor holds (argument {i})"
        written = _Extents((*self.kept, *inputs))
        if any(out is not None and out.data_ptr() not in written for out in outputs):
            return "an output is not what a recorded call wrote"
        return None

    def replay(self) -> bool:
        """Make the recorded calls again, in order; False at the first that returns an error code (the caller runs
        the block's Python, which raises that error)."""
        for fn, args, coded in self.calls:
            if fn(*args) and coded:
                return False
        return True


class _Extents:
    """The bytes some tensors' storages span; `ptr in extents`: whether one holds that address."""

    def __init__(self, tensors):
        spans = sorted({(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in (t.untyped_storage() for t in tensors)})
        self.starts, self.ends = [a for a, _ in spans], [b for _, b in spans]

    def __contains__(self, ptr: int) -> bool:
        i = bisect.bisect_right(self.starts, ptr) - 1
        # A tensor of no elements passes its storage's address, which it does not read: at its start counts.
        return i >= 0 and (ptr < self.ends[i] or ptr == self.starts[i])


def cpu_lasting() -> list[torch.Tensor]:
    """The packs and repacks cpu.py keeps for the weights: lasting like the weights."""
    return [entry[3] for cache in (cpu._packs, cpu._gated_packs, cpu._repacks, cpu._prepacks)
            for entry in list(cache.values())]


class _Recorder:
    """cpu._kernel while a capture runs: each call the capturing thread makes is recorded, then made; other threads'
    calls go through untouched."""

    def __init__(self, lib, rec: Recording):
        self._lib, self._rec = lib, rec

    def __getattr__(self, name):
        real = getattr(self._lib, name)
        if not callable(real) or name in QUERIES:
            return real
        rec = self._rec

        def call(*args):
            if threading.get_ident() == rec._thread:
                if name in PREPARES:
                    rec.refused, rec.again = f"it prepared a weight ({name})", True
                rec.calls.append((real, args, real.restype is not None))
            return real(*args)
        return call


_lock = threading.Lock()


class capture:
    """`with capture() as rec:` records the C calls the block makes on this thread (a Recording), and keeps what the
    wrappers allocate meanwhile. One capture at a time in a process: a second one meanwhile (another engine's, in
    another thread) gives a Recording refused for now (the block runs as usual; the next capture may stand)."""

    def __init__(self, label: str = "block"):
        self.rec = Recording()
        self._range = torch.autograd.profiler.record_function(f"{RANGE}{label}")

    def __enter__(self) -> Recording:
        rec = self.rec
        if cpu.library() is None:
            rec.refused = "the C kernels are not built here"
            return rec
        if not _lock.acquire(blocking=False):
            rec.refused, rec.again = "no capture here now (another one runs)", True
            return rec
        self._saved = cpu._kernel, cpu._empty, cpu._empty_like
        kept = rec.kept
        empty, empty_like = cpu._empty, cpu._empty_like

        def keep(t):
            if threading.get_ident() == rec._thread:
                kept.append(t)
            return t
        cpu._kernel = _Recorder(cpu._kernel, rec)
        cpu._empty = lambda *a, **kw: keep(empty(*a, **kw))
        cpu._empty_like = lambda *a, **kw: keep(empty_like(*a, **kw))
        self._held = True
        self._range.__enter__()
        return rec

    def __exit__(self, *exc) -> None:
        if getattr(self, "_held", False):
            self._range.__exit__(*exc)
            cpu._kernel, cpu._empty, cpu._empty_like = self._saved
            _lock.release()
        if exc[0] is not None:
            self.rec.refused = "it raised"


RANGE = "devharness.capture."   # the profiler range each capture runs in (Watch finds its ops by it)
# torch ops that compute nothing (allocations, views): the only ones a replayable block may run besides the kernels'.
VIEWS = frozenset(f"aten::{n}" for n in (
    "empty", "empty_like", "empty_strided", "view", "reshape", "_reshape_alias", "_unsafe_view", "split_with_sizes",
    "split", "chunk", "unbind", "unsqueeze", "squeeze", "as_strided", "alias", "detach", "slice", "select", "narrow",
    "t", "transpose", "permute", "expand", "lift_fresh", "contiguous", "resolve_conj", "resolve_neg"))


class Watch:
    """`with Watch() as w:` around captures (torch's profiler, which sees every op the dispatcher runs, those inside
    an op's own Python too); then w.computed(): the torch ops that computed inside them, by capture label."""

    def __enter__(self) -> "Watch":
        # Kineto prints a line at each profiler start and stop unless told otherwise before its first start.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._prof = torch.autograd.profiler.profile(use_kineto=False)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)

    def computed(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}

        def walk(event, label):
            for child in event.cpu_children:
                name = child.name
                if not name.startswith("devharness::") and name not in VIEWS:
                    found.setdefault(label, []).append(name)
                walk(child, label)
        for event in self._prof.function_events:
            if event.name.startswith(RANGE):
                walk(event, event.name[len(RANGE):])
        return found
