"""The kernels the model runs: one registry of ops, each with its reference, and the backends that fill it.

Every compute kernel the model calls is an op named here (OPS). Each has a reference in plain torch
(reference.py) and, where devharness has one, a custom kernel (the C kernels of cpu.py, registered as
`torch.ops.devharness.<name>` by fast.py, and called without the dispatcher where nothing watches it: fast.direct).
A backend is one choice per engine (`--kernels`, `LLM(kernels=...)`):

- `reference`: every op's reference.
- `fast` (the default): on the CPU, the custom kernel of each op that has one, except where `devharness bench
  kernels --save` measured the library form faster on this machine; every other op its reference (torch's own
  kernel: F.linear, aten's RMSNorm, SDPA). Where the C kernels cannot be built here (no compiler), it warns once
  and runs `reference`. On CUDA the fast backend is the library kernels: the references.

The worker builds one `Kernels` and hands it to the model (`DecoderForCausalLM.set_kernels`) and to the sampler;
the model imports nothing from here. Debug mode runs the same kernels as serving, so it sees serving's numbers.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from devharness.config import KERNEL_BACKENDS as BACKENDS
from devharness.kernels import reference

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Op:
    """One kernel op: what it computes, its reference, and how close a custom kernel must come to it."""

    name: str
    reference: Callable
    custom: bool           # devharness has its own kernel for it (the fast backend's, on the CPU)
    rtol: float = 0.0      # 0, 0: bit for bit
    atol: float = 0.0
    doc: str = ""
    rows_arg: int = 0      # the argument whose first dimension is the call's rows (a choice may depend on them)
    # Every argument indexed by the call's rows (None: rows_arg alone), so that some of its rows can run alone
    # (`check --batch-invariance` runs the probe's rows alone through the op to see whether their bits change).
    row_args: tuple[int, ...] | None = None

    @property
    def rows_args(self) -> tuple[int, ...]:
        return (self.rows_arg,) if self.row_args is None else self.row_args


OPS: dict[str, Op] = {op.name: op for op in (
    Op("linear", reference.linear, True, 1e-5, 1e-5, "x @ weight^T (+ bias): every projection"),
    Op("gated_linear", reference.gated_linear, True, 1e-5, 1e-5, "silu(x @ gate^T) * (x @ up^T): the MLP's gate/up"),
    Op("linear_argmax", reference.linear_argmax, True, 0, 0,
       "argmax of the LM head's product per row, without the logits: greedy tokens (ties may differ in the "
       "last bit of a logit; the fast kernel is bit for bit its own packed product's argmax)"),
    Op("argmax", reference.argmax, True, 0, 0, "each row's first largest value: greedy and sampled tokens"),
    Op("rms_norm", reference.rms_norm, True, 1e-5, 1e-6, "RMSNorm"),
    Op("add_rms_norm", reference.add_rms_norm, True, 1e-5, 1e-6, "the residual add, then RMSNorm", row_args=(0, 1)),
    Op("rotate", reference.rotate, True, 1e-6, 1e-6, "rotate-half RoPE by gathered cos/sin", row_args=(0, 1, 2)),
    Op("silu_and_mul", reference.silu_and_mul, True, 1e-6, 1e-6, "silu(gate) * up"),
    Op("write_kv", reference.write_kv, True, 0, 0, "this step's keys and values into the paged cache", rows_arg=2),
    Op("paged_decode", reference.paged_decode, True, 1e-5, 1e-5, "decode attention over the paged cache",
       row_args=(0, 3, 4)),
    # rotate, write_kv and paged_decode in one call, for a step whose tokens are all decodes (Kernels.fuses).
    Op("decode_attention", reference.decode_attention, True, 1e-5, 1e-5,
       "a step of decodes: RoPE of q and k, the keys and values into the paged cache, the attention over it",
       row_args=(0, 1, 2, 3, 4, 7, 8, 9)),
    # Weights kept in GGUF's quantized blocks (reference.dequantize): each op's reference dequantizes the blocks and
    # runs the float op; the custom kernel dequantizes each block in registers as it reads it (cpu.q_linear).
    Op("q_linear", reference.q_linear, True, 1e-5, 1e-5, "linear with the weight in Q8_0 or Q4_1 blocks"),
    Op("q_gated_linear", reference.q_gated_linear, True, 1e-5, 1e-5, "gated_linear with the weight in blocks"),
    Op("q_linear_argmax", reference.q_linear_argmax, True, 0, 0,
       "linear_argmax with the LM head in blocks (the fast kernel: bit for bit its own product's argmax)"),
    Op("q_embedding", reference.q_embedding, True, 0, 0, "the embedding's rows of ids, kept in blocks",
       rows_arg=0),
    Op("prefill_attention", reference.prefill_attention, True, 1e-5, 1e-5, "a prompt chunk's causal attention",
       row_args=()),   # one request's chunk a call
)}


# A fused op -> the ops it computes in one call, in their order (its reference is theirs, one after the other).
FUSED = {"decode_attention": ("rotate", "write_kv", "paged_decode")}


class Kernels:
    """The kernels one engine runs: an attribute per op of OPS (`kernels.linear(x, w)`), all from one backend.

    `backend` is what was asked for and ran ("fast" or "reference"); `choices` names, per op, what runs it
    ("custom", or "library": the op's reference, torch's kernel). `decode_rows_per_call`: how many decode rows
    the runner gives the decode attention at once (None: all of a step's), since the reference pads every row
    to its call's longest context and the custom kernel reads each row to its own length."""

    def __init__(self, backend: str, impls: dict[str, Callable], choices: dict[str, str],
                 decode_rows_per_call: int | None, records: bool = False):
        self.backend, self.choices, self.decode_rows_per_call = backend, dict(choices), decode_rows_per_call
        for name in OPS:
            setattr(self, name, impls[name])
        self._built = {name: impls[name] for name in OPS}
        # A fused op's own kernel saves only the Python between its parts' calls: fused only where every one of
        # them is the custom kernel (the reference backend runs the parts).
        self._custom = {name for name, parts in FUSED.items()
                        if all(self.choices[op] == "custom" for op in (name, *parts))}
        self._records = records   # the C kernels' calls can be recorded (records(): the fast backend, built)

    def fuses(self, name: str) -> bool:
        """Whether the model may call the fused op `name` (FUSED) in place of its parts: where this backend runs
        the custom kernel of it and of each part, and none of them has been replaced since it was built. A planted
        fault or an op capture (`check`) replaces the op it wraps: the model then calls the parts one by one, so
        that what wraps one of them sees its calls."""
        return name in self._custom and self._unreplaced((name, *FUSED[name]))

    def _unreplaced(self, names) -> bool:
        """Whether each op of `names` is still the one this backend was built with (nothing wraps it)."""
        built = self._built
        for name in names:
            if getattr(self, name) is not built[name]:
                return False
        return True

    def records(self) -> bool:
        """Whether a block of the model may run as recorded kernel calls now (capture, graph.py): where this backend
        makes them (the fast one, its C kernels built), no op has been replaced since it was built (a planted fault
        or `check`'s capture wraps one: the Python then runs, so that it sees the calls) and nothing watches torch's
        dispatcher (a profiler, a dispatch mode, torch.compile: they see the ops by name)."""
        if not self._records or not self._unreplaced(OPS):
            return False
        from devharness.kernels import fast
        return not fast.watched()

    def capture(self, label: str):
        """`with kernels.capture(label) as rec:` records the C calls the block makes (graph.capture; seal it with its
        inputs, the tensors that outlive the step and its outputs, then rec.replay() makes the calls again). Run
        captures inside `with kernels.watch() as w:`; w.computed() names the torch ops that computed in them by
        label (a capture where any did cannot stand for its block)."""
        from devharness.kernels import graph
        return graph.capture(label)

    def watch(self):
        from devharness.kernels import graph
        return graph.Watch()

    def prepare(self, weights: list[tuple[str, "torch.Tensor"]]) -> int:
        """Ready the (op, weight) pairs a model will hand its ops (DecoderForCausalLM.weights_by_op): the custom
        linear kernels pack each weight now rather than in the first step. Returns the bytes the packs hold."""
        if self.backend != "fast" or all(self.choices[n] == "library" for n in ("linear", "gated_linear")):
            return 0
        from devharness.kernels import cpu
        total = 0
        for op, weight in weights:
            if self.choices.get(op, "library") == "library":
                continue
            packed = cpu.packed_gated_weight(weight) if op == "gated_linear" else cpu.packed_weight(weight)
            total += 0 if packed is None else packed.numel() * packed.element_size()
        return total

    def __repr__(self) -> str:
        return f"Kernels({self.backend!r})"


# Decode rows per call of the reference attention: a group's rows have similar contexts (little padding), and the
# calls stay few.
REFERENCE_DECODE_ROWS = 16


def check_backend(backend) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"kernels={backend!r}: must be one of {', '.join(BACKENDS)}")
    return backend


def reference_kernels() -> Kernels:
    return Kernels("reference", {name: op.reference for name, op in OPS.items()},
                   {name: "library" for name in OPS}, REFERENCE_DECODE_ROWS)


def kernels_for(backend: str, device_type: str = "cpu", batch_invariant: bool = False) -> Kernels:
    """The Kernels of `backend` (BACKENDS) for tensors on `device_type`. The fast backend on a CPU whose C kernels
    cannot be built warns once (cpu.library()) and gives the reference kernels, named "reference".
    `batch_invariant`: every op with a custom kernel runs it, at every row count, whatever was saved: each custom
    kernel computes a row alone, in one order (the library forms, torch's, may not)."""
    check_backend(backend)
    if backend == "reference" or device_type != "cpu":
        kernels = reference_kernels()
        if backend == "fast":   # on CUDA the library kernels are the fast ones
            kernels.backend = "fast"
        return kernels
    from devharness.kernels import cpu, fast
    if cpu.library() is None:
        return reference_kernels()
    saved = {} if batch_invariant else saved_choices()
    registered = fast.direct()
    impls, choices = {}, {}
    for name, op in OPS.items():
        choice = saved.get(name, "custom") if op.custom else "library"
        max_rows = custom_max_rows(choice)
        if choice == "custom":
            impls[name] = registered[name]
        elif max_rows is None:
            choice, impls[name] = "library", op.reference
        else:
            impls[name] = _by_rows(registered[name], op.reference, max_rows, op.rows_arg)
        choices[name] = choice
    return Kernels("fast", impls, choices, None if choices["paged_decode"] != "library" else REFERENCE_DECODE_ROWS,
                   records=True)


def custom_max_rows(choice: str) -> int | None:
    """The rows up to which a choice runs the custom kernel: "custom<=N" is N; any other, None."""
    if choice.startswith("custom<="):
        try:
            return int(choice[len("custom<="):])
        except ValueError:
            return None
    return None


def _by_rows(custom: Callable, library: Callable, max_rows: int, rows_arg: int) -> Callable:
    """custom for calls of at most max_rows rows, library above (where `bench kernels` measured it faster)."""
    def op(*args):
        return custom(*args) if args[rows_arg].shape[0] <= max_rows else library(*args)
    op.__name__ = f"{getattr(custom, '__name__', 'custom')}_up_to_{max_rows}_rows"
    return op


def choices_key() -> str:
    """What a saved choice holds for: the CPU's feature flags and the C source, since a faster kernel on one
    machine may be slower on another."""
    import hashlib
    from devharness.kernels import cpu
    return hashlib.sha256((cpu.SOURCE + cpu._cpu_flags()).encode()).hexdigest()[:16]


def choices_path() -> Path:
    """Where `bench kernels --save` leaves the ops whose library form it measured faster on this machine."""
    return Path(os.environ.get("DEVHARNESS_CACHE") or Path.home() / ".cache" / "devharness") / \
        f"kernel-choices-{choices_key()}.json"


def save_choices(choices: dict[str, str], **about) -> Path:
    """Write `choices` (op -> "custom", "library" or "custom<=N": the custom kernel up to N rows) where kernels_for("fast") reads them (choices_path()), with
    `about` (what they were measured on: the CPU, the date, the model, the table) beside them; returns the path."""
    path = choices_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"choices": choices, "key": choices_key(), **about}, indent=1))
    os.replace(tmp, path)   # atomic: an engine starting meanwhile reads the old file or the new one
    return path


def saved_choices() -> dict[str, str]:
    """What `bench kernels --save` chose here, per op ("custom", "library" or "custom<=N"; none where it never ran,
    or for a choice it does not recognise)."""
    try:
        data = json.loads(choices_path().read_text())
        found = data.get("choices", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return {name: c for name, c in found.items() if name in OPS and isinstance(c, str)
            and (c in ("custom", "library") or custom_max_rows(c) is not None)}
