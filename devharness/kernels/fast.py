"""The fast backend's CPU ops: each a `torch.library` op `devharness::<name>` (so profilers, dispatch modes and
torch.compile see it by name) whose CPU implementation runs the C kernel of cpu.py where it takes the tensors
and the op's reference (reference.py) where it does not (another dtype or layout), and whose fake (meta)
implementation gives the output's shape. Registered once per process, on first use.

The engine calls each op's implementation directly (direct()): torch's dispatcher costs a few microseconds a call,
and a decode step makes hundreds of calls. While torch's profiler records, a dispatch mode is active or
torch.compile traces, each call goes through the registered op, so they see it by name as before."""
from __future__ import annotations

import threading

import torch

from devharness.kernels import cpu, reference

NAMESPACE = "devharness"

# name -> (schema, CPU implementation, fake implementation). Each implementation takes the schema's arguments.


def _linear(x, weight, bias=None):
    if x.dim() == 2 and x.shape[0] and x.shape[1] == weight.shape[1] and x.dtype == torch.float32 \
            and x.device.type == "cpu":   # else the reference names the mismatch
        packed = cpu.packed_weight(weight)
        if packed is not None:
            y = cpu.packed_linear(x, packed, weight.shape[0])
            return y if bias is None else y.add_(bias)
    return reference.linear(x, weight, bias)


def _gated_linear(x, weight, bias=None):
    if bias is None and x.dim() == 2 and x.shape[0] and x.shape[1] == weight.shape[1] \
            and x.dtype == torch.float32 and x.device.type == "cpu":
        packed = cpu.packed_gated_weight(weight)
        if packed is not None:
            return cpu.packed_gated_linear(x, packed, weight.shape[0] // 2)
    return reference.gated_linear(x, weight, bias)


def _linear_argmax(x, weight, num_valid):
    if x.dim() == 2 and x.shape[0] and x.shape[1] == weight.shape[1] and x.dtype == torch.float32 \
            and x.device.type == "cpu":
        packed = cpu.packed_weight(weight)
        if packed is not None:
            done = cpu.packed_linear_argmax(x, packed, weight.shape[0], num_valid)
            if done is not None:
                return done
    return reference.argmax(_linear(x, weight)[:, :num_valid])   # the same products, so the same tokens


def _argmax(x):
    if x.numel() and (done := cpu.argmax(x)) is not None:
        return done
    return reference.argmax(x)


def _rms_norm(x, weight, eps):
    if (done := cpu.rms_norm(x, weight, eps)) is not None:
        return done[0]
    return reference.rms_norm(x, weight, eps)


def _add_rms_norm(x, residual, weight, eps):
    if (done := cpu.rms_norm(x, weight, eps, residual)) is not None:
        return done
    return reference.add_rms_norm(x, residual, weight, eps)


def _rotate(x, cos, sin):
    if (done := cpu.rotate(x, cos, sin)) is not None:
        return done
    return reference.rotate(x, cos, sin)


def _silu_and_mul(gate_up):
    if (done := cpu.silu_and_mul(gate_up)) is not None:
        return done
    return reference.silu_and_mul(gate_up)


def _write_kv(k_cache, v_cache, slot_mapping, k, v):
    if not cpu.write_kv(k_cache, v_cache, slot_mapping, k, v):
        reference.write_kv(k_cache, v_cache, slot_mapping, k, v)


def _paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    if cpu.supports(q, k_cache, v_cache) and cpu.library() is not None:
        return cpu.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    return reference.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)


def _decode_attention(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_tables, context_lens, scale):
    done = cpu.decode_attention(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_tables, context_lens, scale)
    if done is not None:
        return done
    # Its parts, each its custom kernel where that takes the tensors: the numbers the unfused step gives.
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    _write_kv(k_cache, v_cache, slot_mapping, k, v)
    return _paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)


def _prefill_attention(q, k, v, k_cache, v_cache, block_ids, context_len, scale):
    done = cpu.prefill_attention(q, k, v, k_cache, v_cache, block_ids, context_len, scale)
    if done is not None:
        return done
    return reference.prefill_attention(q, k, v, k_cache, v_cache, block_ids, context_len, scale)


def _q_linear(x, blocks, qtype, bias=None):
    if x.shape[0] and (y := cpu.q_linear(x, blocks, qtype)) is not None:
        return y if bias is None else y.add_(bias)
    return reference.q_linear(x, blocks, qtype, bias)


def _q_gated_linear(x, blocks, qtype, bias=None):
    if bias is None and x.shape[0] and (y := cpu.q_linear(x, blocks, qtype, gated=True)) is not None:
        return y
    return reference.q_gated_linear(x, blocks, qtype, bias)


def _q_linear_argmax(x, blocks, qtype, num_valid):
    if x.shape[0] and 0 < num_valid <= blocks.shape[0] and (y := cpu.q_linear(x, blocks, qtype)) is not None:
        return _argmax(y[:, :num_valid].contiguous())   # the argmax of its own product
    return reference.q_linear_argmax(x, blocks, qtype, num_valid)


def _q_embedding(ids, blocks, qtype):
    if (y := cpu.q_embedding(ids, blocks, qtype)) is not None:
        return y
    return reference.q_embedding(ids, blocks, qtype)


def _q_embedding_fake(ids, blocks, qtype):
    size = reference.BLOCK_BYTES.get(qtype, 1)
    return blocks.new_empty(*ids.shape, blocks.shape[1] // size * 32, dtype=torch.float32)


def _rows(x, n):
    return x.new_empty(x.shape[0], n)


OPS = {
    "linear": ("(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor", _linear,
               lambda x, weight, bias=None: _rows(x, weight.shape[0])),
    "gated_linear": ("(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor", _gated_linear,
                     lambda x, weight, bias=None: _rows(x, weight.shape[0] // 2)),
    "linear_argmax": ("(Tensor x, Tensor weight, int num_valid) -> Tensor", _linear_argmax,
                      lambda x, weight, num_valid: x.new_empty(x.shape[0], dtype=torch.int64)),
    "argmax": ("(Tensor x) -> Tensor", _argmax, lambda x: x.new_empty(x.shape[0], dtype=torch.int64)),
    "rms_norm": ("(Tensor x, Tensor weight, float eps) -> Tensor", _rms_norm,
                 lambda x, weight, eps: torch.empty_like(x)),
    "add_rms_norm": ("(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)", _add_rms_norm,
                     lambda x, residual, weight, eps: (torch.empty_like(x), torch.empty_like(x))),
    "rotate": ("(Tensor x, Tensor cos, Tensor sin) -> Tensor", _rotate,
               lambda x, cos, sin: x.new_empty(x.shape)),
    "silu_and_mul": ("(Tensor gate_up) -> Tensor", _silu_and_mul,
                     lambda gate_up: _rows(gate_up, gate_up.shape[1] // 2)),
    "write_kv": ("(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor k, Tensor v) -> ()", _write_kv,
                 lambda k_cache, v_cache, slot_mapping, k, v: None),
    "paged_decode": ("(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
                     "float scale) -> Tensor", _paged_decode,
                     lambda q, k_cache, v_cache, block_tables, context_lens, scale: torch.empty_like(q)),
    "decode_attention": ("(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
                         "Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, "
                         "float scale) -> Tensor", _decode_attention,
                         lambda q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_tables, context_lens,
                         scale: torch.empty_like(q)),
    "prefill_attention": ("(Tensor q, Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor block_ids, "
                          "int context_len, float scale) -> Tensor", _prefill_attention,
                          lambda q, k, v, k_cache, v_cache, block_ids, context_len, scale: torch.empty_like(q)),
    "q_linear": ("(Tensor x, Tensor blocks, int qtype, Tensor? bias=None) -> Tensor", _q_linear,
                 lambda x, blocks, qtype, bias=None: _rows(x, blocks.shape[0])),
    "q_gated_linear": ("(Tensor x, Tensor blocks, int qtype, Tensor? bias=None) -> Tensor", _q_gated_linear,
                       lambda x, blocks, qtype, bias=None: _rows(x, blocks.shape[0] // 2)),
    "q_linear_argmax": ("(Tensor x, Tensor blocks, int qtype, int num_valid) -> Tensor", _q_linear_argmax,
                        lambda x, blocks, qtype, num_valid: x.new_empty(x.shape[0], dtype=torch.int64)),
    "q_embedding": ("(Tensor ids, Tensor blocks, int qtype) -> Tensor", _q_embedding, _q_embedding_fake),
}

_lock = threading.Lock()
_library: torch.library.Library | None = None


def registered() -> dict[str, object]:
    """name -> torch.ops.devharness.<name>.default for every op in OPS, registered on the first call."""
    global _library
    with _lock:
        if _library is None:
            lib = torch.library.Library(NAMESPACE, "FRAGMENT")
            for name, (schema, impl, fake) in OPS.items():
                lib.define(name + schema)
                lib.impl(name, impl, "CPU")
                torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
            _library = lib
    ns = getattr(torch.ops, NAMESPACE)
    return {name: getattr(ns, name).default for name in OPS}


def direct() -> dict[str, object]:
    """name -> a callable computing the op as torch.ops.devharness.<name> does, by calling its CPU implementation
    without the dispatcher, except where something watches the dispatcher (torch's profiler records, a dispatch mode
    is active, torch.compile traces): then through the registered op, which they see by name."""
    ops = registered()
    return {name: _direct(name, impl, ops[name]) for name, (_, impl, _) in OPS.items()}


# torch's process-wide flag that a profiler records (set by every torch.profiler and autograd profile, one that
# profiles all threads from another thread included), beside the calling thread's own state.
_profiler = torch.autograd.profiler
_profiling = torch.autograd._profiler_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_compiling = torch.compiler.is_dynamo_compiling


def watched() -> bool:
    """Whether something watches torch's dispatcher on this thread now (the ops then go through it)."""
    return bool(_profiler._is_profiler_enabled or _profiling() or _dispatch_modes() or _compiling())


def _direct(name: str, impl, dispatched):
    def op(*args, **kwargs):
        if _profiler._is_profiler_enabled or _profiling() or _dispatch_modes() or _compiling():
            return dispatched(*args, **kwargs)
        return impl(*args, **kwargs)
    op.__name__ = op.__qualname__ = name
    return op
