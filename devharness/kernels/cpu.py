"""The fast backend's CPU kernels in C (native.c beside this file), built with the machine's C compiler on first
use and called through ctypes, which releases the GIL while they run.

- The decode attention. The reference gathers every row's blocks into a padded copy and hands it to SDPA,
  whose CPU kernel is made for long queries: for one query per row it spends most of its time on set-up, and
  the gather writes and reads the keys and values once more. This kernel reads the cache in place, a row at a
  time with all its heads, block by block in one pass (online softmax).
- The linear layers, over a copy of each weight packed once into panels (packed_weight): BLAS's GEMM is
  built for large products; at decode's few rows it reaches a fraction of the CPU's rate, which the packed
  tiles reach. `devharness bench kernels` sets each against the library's forms on the model's shapes.
- RMSNorm with the residual add, RoPE and SiLU-and-mul: a pass over each row instead of an op, and a
  temporary, per step of the formula; in the MLP, SiLU-and-mul runs in the gate/up product's registers
  (packed_gated_linear), so that product is never written; greedy sampling's argmax, also straight from the
  LM head's packed product (packed_linear_argmax), which never writes the logits.

native.c is plain C with OpenMP and GCC's vector extensions (no Python or torch headers, no intrinsics: the same
source builds for AVX-512, AVX2 or another -march), so it compiles in about a second with `cc -O3 -march=native
-fopenmp`; the shared object is cached by the hash of its source, compiler, flags and CPU (-march=native code may
not run on another) under $DEVHARNESS_CACHE (default ~/.cache/devharness). Where no compiler is found or the
build fails, `library()` returns None once and for all (logged once) and the engine runs the reference kernels.
Each wrapper takes float32 CPU tensors of the layouts it names and returns None (the op then runs its reference)
for others. The kernels run on as many threads as torch's ops in the calling thread (`torch.get_num_threads()`).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# The kernels' C source, beside this file; a build is cached by its hash (see _build).
SOURCE = (Path(__file__).with_name("native.c")).read_text()
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared"]

_lock = threading.Lock()
_kernel: ctypes.CDLL | None = None
_F32, _I64, _U8 = torch.float32, torch.int64, torch.uint8
# What the wrappers allocate their outputs with: a recording (graph.py) swaps in forms that keep what they make alive
# for the recorded calls' replays.
_empty, _empty_like = torch.empty, torch.empty_like
_tried = False


def _cache_dir() -> Path:
    return Path(os.environ.get("DEVHARNESS_CACHE") or Path.home() / ".cache" / "devharness") / "native"


def _cpu_flags() -> str:
    """What -march=native compiles for: the CPU's feature flags, where /proc/cpuinfo tells them."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build(defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build (or load from the cache) the kernels; `defines` are extra -D flags (the tests build the other vector
    width, -DVW=16 or -DVW=8, to run both code paths on one machine)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    flags = [*FLAGS, *defines]
    key = hashlib.sha256("\0".join([SOURCE, cc, *flags, platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, obj = Path(tmp) / "paged_decode.c", Path(tmp) / "paged_decode.so"
            src.write_text(SOURCE)
            done = subprocess.run([cc, *flags, str(src), "-o", str(obj), "-lm"], capture_output=True, text=True,
                                  timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{cc} failed: {done.stderr.strip()[:500]}")
            os.replace(obj, target)   # atomic: processes building at once leave one whole file
    lib = ctypes.CDLL(str(target))
    fn = lib.paged_decode_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int64]
    lib.decode_attention_f32.restype = ctypes.c_int
    lib.decode_attention_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64] * 3 + [ctypes.c_void_p] * 8 + \
        [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int64]
    lib.prefill_attention_f32.restype = ctypes.c_int
    lib.prefill_attention_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3 + \
        [ctypes.c_int64] * 3 + [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int, ctypes.c_int64]
    lib.linear_panel.restype = ctypes.c_int
    lib.linear_panel.argtypes = []
    lib.pack_linear_f32.restype = None
    lib.pack_linear_f32.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.rms_norm_f32.restype = None
    lib.rms_norm_f32.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
    lib.silu_mul_f32.restype = None
    lib.silu_mul_f32.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.rope_f32.restype = None
    lib.rope_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.packed_gated_linear_f32.restype = None
    lib.packed_gated_linear_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.kv_write_f32.restype = ctypes.c_int
    lib.kv_write_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64] + \
        [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.argmax_rows_f32.restype = None
    lib.argmax_rows_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.packed_linear_argmax_f32.restype = ctypes.c_int
    lib.packed_linear_argmax_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    lib.packed_linear_f32.restype = None
    lib.packed_linear_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.q_linear_f32.restype = ctypes.c_int
    lib.q_linear_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 3
    lib.q_linear_repacked_f32.restype = ctypes.c_int
    lib.q_linear_repacked_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 3
    lib.q_repack_bytes.restype = ctypes.c_int64
    lib.q_repack_bytes.argtypes = [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.q_repack_f32.restype = None
    lib.q_repack_f32.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2
    lib.q_tiled_rows.restype = ctypes.c_int
    lib.q_tiled_rows.argtypes = []
    lib.tiled_rows = lib.q_tiled_rows()   # rows of x from which q_linear_f32 tiles; below, the repack's kernel
    lib.q_linear_prepacked_f32.restype = ctypes.c_int
    lib.q_linear_prepacked_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 3
    lib.q_prepack_bytes.restype = ctypes.c_int64
    lib.q_prepack_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.q_prepack_f32.restype = None
    lib.q_prepack_f32.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                  ctypes.c_int]
    lib.q_prep_rows.restype = ctypes.c_int
    lib.q_prep_rows.argtypes = [ctypes.c_int]
    # rows of x from which q_linear reads the panel repack (not gated, gated)
    lib.prep_rows = (lib.q_prep_rows(0), lib.q_prep_rows(1))
    lib.q_rows_f32.restype = ctypes.c_int
    lib.q_rows_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.panel = lib.linear_panel()   # output columns a packed panel holds (16 with AVX-512, else 8)
    return lib


def library() -> ctypes.CDLL | None:
    """The built library of every kernel in SOURCE (named for the first of them), or None where it cannot be
    built here (logged once)."""
    global _kernel, _tried
    if _tried:   # every decode call asks: no lock once it is settled
        return _kernel
    with _lock:
        if not _tried:
            try:
                _kernel = _build()
            except Exception as e:
                logger.warning("the fast kernels cannot be built here (%s); running the reference kernels", e)
            _tried = True   # after _kernel is set: a caller that sees it settled sees the kernel too
    return _kernel


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The paged_decode op's contract (q [B, Hq, D], caches [num_blocks, block_size, Hkv, D], block_tables
    [B, max_blocks], context_lens [B]; returns [B, Hq, D]), computed by the C kernel. The caller checks
    `supports(...)` and `library()` first."""
    lib = _kernel
    b, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    q = q.contiguous()
    tables = block_tables.contiguous().to(torch.int64)
    lens = context_lens.contiguous().to(torch.int64)
    out = _empty_like(q)
    rc = lib.paged_decode_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                              lens.data_ptr(), out.data_ptr(), b, hkv, hq // hkv, d, bs, tables.shape[1], scale,
                              max(1, min(b, torch.get_num_threads())), k_cache.shape[0])
    _raise_for_decode(rc, tables.shape[1], k_cache.shape[0])
    return out


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """The decode_attention op's contract (q [B, Hq, D], k and v [B, Hkv, D], cos/sin [B, 1, D], caches
    [num_blocks, block_size, Hkv, D], slot_mapping [B], block_tables [B, max_blocks], context_lens [B]; returns
    [B, Hq, D]) by the C kernel: rotate, write_kv and paged_decode in one call, their kernels' bits. q, k and v may
    be views of the qkv product (rows any stride apart, heads contiguous). None where it does not take these
    tensors (the op then runs its parts)."""
    if library() is None or q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or cos.dim() != 3:
        return None
    b, hq, d = q.shape
    hkv = k.shape[1]
    if d % 2 or k.shape[0] != b or k.shape[2] != d or hkv == 0 or hq % hkv or k_cache.dim() != 4 \
            or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:] \
            or cos.shape != (b, 1, d) or sin.shape != (b, 1, d) or not _plain(cos, sin, k_cache, v_cache) \
            or slot_mapping.dtype != torch.int64 or not slot_mapping.is_cpu or not slot_mapping.is_contiguous() \
            or slot_mapping.shape != (b,) or block_tables.dim() != 2 or block_tables.shape[0] != b \
            or context_lens.shape != (b,):
        return None
    for x in (q, k, v):
        if x.dtype != _F32 or not x.is_cpu or x.stride(2) != 1 or x.stride(1) != d:
            return None
    num_blocks, bs = k_cache.shape[:2]
    tables, lens = _int64(block_tables), _int64(context_lens)
    out = _empty(b, hq, d, dtype=_F32, device=q.device)   # never torch's default device
    rc = _kernel.decode_attention_f32(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                      cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                      slot_mapping.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(), b,
                                      hkv, hq // hkv, d, bs, tables.shape[1], scale,
                                      max(1, min(b, torch.get_num_threads())), num_blocks)
    if rc == -3:
        raise _slot_error(slot_mapping, num_blocks * bs)
    _raise_for_decode(rc, tables.shape[1], num_blocks)
    return out


def _int64(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous int64 CPU tensor: itself where it is one (most calls: a no-op .to() still costs a dispatch)."""
    return t if t.dtype == _I64 and t.is_cpu and t.is_contiguous() else t.contiguous().to(torch.int64)


def _raise_for_decode(rc: int, width: int, num_blocks: int) -> None:
    """The decode attention's error for its return code (0: none): -2 a block table that does not cover a context
    or names a block outside the cache, -1 out of memory."""
    if rc == -2:
        raise IndexError(f"native decode attention: a context needs blocks its table ({width} wide) "
                         f"does not hold, or names a block outside the cache's {num_blocks}")
    if rc:
        raise MemoryError("native decode attention: out of memory for its scores")


def _slot_error(slots: torch.Tensor, num_slots: int) -> IndexError:
    return IndexError(f"native KV write: a slot of {slots.tolist()} is outside the cache's {num_slots}")


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, block_ids: torch.Tensor, context_len: int,
                      scale: float) -> torch.Tensor | None:
    """The prefill_attention op's contract (q [n, Hq, D] at the last n of context_len positions; k and v [n, Hkv, D],
    read where nothing was cached before the chunk; else the caches' [num_blocks, block_size, Hkv, D] first
    context_len rows of the blocks block_ids; returns [n, Hq, D]) by the C kernel: the scores a tile of heads at a
    time as the linear layers' products. q, k and v may be views of the qkv product (rows any stride apart, heads
    contiguous). None where it does not take these tensors, or the blocks do not hold the context (the reference
    then runs, and names what is wrong)."""
    if library() is None or q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k_cache.dim() != 4 \
            or k_cache.shape != v_cache.shape or not _plain(k_cache, v_cache) or block_ids.dim() != 1 \
            or block_ids.dtype not in (torch.int64, torch.int32) or not block_ids.is_cpu:
        return None
    n, hq, d = q.shape
    hkv = k.shape[1]
    if not 0 < n <= context_len or k.shape[0] != n or k.shape[2] != d or hkv == 0 or hq % hkv \
            or k_cache.shape[2:] != k.shape[1:]:
        return None
    for x in (q, k, v):
        if x.dtype != _F32 or not x.is_cpu or x.stride(2) != 1 or x.stride(1) != d:
            return None
    num_blocks, bs = k_cache.shape[:2]
    ids = _int64(block_ids)
    out = _empty(n, hq, d, dtype=_F32, device=q.device)   # never torch's default device
    rc = _kernel.prefill_attention_f32(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                                       v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), ids.data_ptr(),
                                       ids.shape[0], context_len, n, out.data_ptr(), hkv, hq // hkv, d, bs, scale,
                                       torch.get_num_threads(), num_blocks)
    return out if rc == 0 else None


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The C kernel takes these tensors: float32 on the CPU, the caches contiguous."""
    return q.dtype == _F32 and q.is_cpu and _plain(k_cache, v_cache)


# Weights packed for packed_linear and for packed_gated_linear: id(weight) -> (a weak reference to the weight,
# the version and storage it was packed from, the pack). A dropped weight's entry goes with it (the reference's
# callback), so a dropped model drops its packs. A plain dict by id: a WeakIdKeyDictionary lookup builds a
# reference object per call, a fifth of the Python time of a decode forward's 120 products.
_packs: dict[int, tuple] = {}
_gated_packs: dict[int, tuple] = {}


def _forget(cache: dict, key: int):
    def drop(ref) -> None:
        entry = cache.get(key)
        if entry is not None and entry[0] is ref:
            del cache[key]
    return drop


def _pack(weight: torch.Tensor, gated: bool) -> torch.Tensor | None:
    """packed_weight (gated: packed_gated_weight): the cached pack while the weight is unchanged, else a new one;
    None where the kernels are not built here, the weight is not a contiguous float32 CPU matrix or (gated) its
    halves are not whole panels."""
    cache = _gated_packs if gated else _packs
    entry = cache.get(id(weight))
    if entry is not None and entry[0]() is weight and entry[1] == weight._version \
            and entry[2] == weight.data_ptr():
        return entry[3]   # packed before (so it passed the checks below), unchanged since
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu" \
            or not weight.is_contiguous() or library() is None:
        return None
    n, k = weight.shape
    panel = _kernel.panel
    if gated and n % (2 * panel):
        return None
    source = weight
    if gated:   # gate rows and up rows of the same columns side by side, a panel of each at a time
        source = weight.view(2, n // (2 * panel), panel, k).transpose(0, 1).contiguous()
    packed = _empty(-(-n // panel) * panel * k, dtype=torch.float32, device=weight.device)
    _kernel.pack_linear_f32(source.data_ptr(), packed.data_ptr(), n, k, torch.get_num_threads())
    cache[id(weight)] = (weakref.ref(weight, _forget(cache, id(weight))), weight._version, weight.data_ptr(), packed)
    return packed


def packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] packed for packed_linear: made on first use, made again once the weight is written to
    (its version moves) or replaced (its storage moves); None where the kernels are not built here or the
    weight is not a contiguous float32 CPU matrix. A pack holds as many bytes as its weight. A write through
    `.data` bypasses the version counter and is not seen: the loaders write that way, but before the first
    forward packs anything. In a debugger, edit a weight in place through the parameter (`w.mul_(2)`), which
    moves its version."""
    return _pack(weight, gated=False)


def packed_gated_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A gate/up projection `weight` [2I, K] (gate rows first) packed for packed_gated_linear: its rows
    interleaved a panel at a time, then packed; made again when the weight changes, like packed_weight. None
    where packed_weight's would be, or where I is not a multiple of the panel width."""
    return _pack(weight, gated=True)


def _check_pack(packed: torch.Tensor, rows: int, k: int) -> None:
    """A pack of a [rows, k] weight has its rows padded to whole panels: any other size means x's width is
    not the weight's (the kernel would read the pack as another layout)."""
    panel = _kernel.panel
    if packed.numel() != -(-rows // panel) * panel * k:
        raise ValueError(f"a packed weight of {packed.numel()} floats is not {rows} x {k}: x has {k} features")


def packed_gated_linear(x: torch.Tensor, packed: torch.Tensor, intermediate: int) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T), [M, intermediate], for the projection `packed` was made from
    (packed_gated_weight)."""
    x = x.contiguous()
    m, k = x.shape
    _check_pack(packed, 2 * intermediate, k)
    y = _empty(m, intermediate, dtype=torch.float32, device=x.device)
    _kernel.packed_gated_linear_f32(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, intermediate, k,
                                    torch.get_num_threads())
    return y


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] @ weight^T for the weight `packed` was made from (packed_weight): [M, out_features]."""
    x = x.contiguous()
    m, k = x.shape
    _check_pack(packed, out_features, k)
    y = _empty(m, out_features, dtype=torch.float32, device=x.device)
    _kernel.packed_linear_f32(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, out_features, k,
                              torch.get_num_threads())
    return y


def packed_linear_argmax(x: torch.Tensor, packed: torch.Tensor, out_features: int, num_valid: int) -> torch.Tensor | None:
    """The index of the largest of each row of (x [M, K] @ weight^T)[:, :num_valid], weight [out_features, K] the
    one `packed` was made from (packed_weight): packed_linear then argmax, bit for bit, in one C pass that never
    writes the [M, out_features] product. int64 [M]; None where memory for the pass runs out."""
    x = x.contiguous()
    m, k = x.shape
    _check_pack(packed, out_features, k)
    if not 0 < num_valid <= out_features < 1 << 31:
        raise ValueError(f"{num_valid} columns of {out_features}: must be 1 to {out_features}")
    out = _empty(m, dtype=torch.int64, device=x.device)
    if _kernel.packed_linear_argmax_f32(x.data_ptr(), packed.data_ptr(), out.data_ptr(), m, out_features, num_valid,
                                        k, torch.get_num_threads()):
        return None
    return out


def _plain(*tensors: torch.Tensor) -> bool:
    # A loop, not all(generator), and is_cpu, not device.type (a device object a call): these checks run a few
    # hundred times a forward.
    for t in tensors:
        if t.dtype != _F32 or not t.is_cpu or not t.is_contiguous():
            return False
    return True


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> bool:
    """k and v [T, Hkv, D] (rows any stride apart, heads contiguous) into the caches [num_blocks, block_size, Hkv, D]
    at slot_mapping [T] (block * block_size + offset), by the C kernel; False (nothing written) where it does not
    take these tensors. A slot outside the caches is an IndexError, as index_copy_'s."""
    if library() is None or k.dim() != 3 or k.shape != v.shape or k_cache.shape != v_cache.shape \
            or k_cache.shape[2:] != k.shape[1:] or slot_mapping.dtype != torch.int64 \
            or not slot_mapping.is_cpu or not slot_mapping.is_contiguous() \
            or slot_mapping.shape != k.shape[:1] or not _plain(k_cache, v_cache):
        return False
    t, hkv, d = k.shape
    for x in (k, v):
        if x.dtype != _F32 or not x.is_cpu or x.stride(2) != 1 or x.stride(1) != d:
            return False
    rc = _kernel.kv_write_f32(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                              v_cache.data_ptr(), slot_mapping.data_ptr(), t, hkv * d,
                              k_cache.shape[0] * k_cache.shape[1])
    if rc:
        raise _slot_error(slot_mapping, k_cache.shape[0] * k_cache.shape[1])
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(RMSNorm of x, None), or with `residual` (RMSNorm of x + residual, x + residual), by the C kernel over
    the last dimension; None where it does not take these tensors (the op runs its reference)."""
    h = x.shape[-1]
    if (_kernel is None and library() is None) or weight.shape != (h,) \
            or not (_plain(x, weight) if residual is None else residual.shape == x.shape and _plain(x, weight, residual)):
        return None
    rows = x.numel() // h if h else 0
    out = _empty_like(x)
    if residual is None:
        _kernel.rms_norm_f32(x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), None, rows, h, eps,
                             torch.get_num_threads())
        return out, None
    res = _empty_like(x)
    _kernel.rms_norm_f32(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), res.data_ptr(), rows, h,
                         eps, torch.get_num_threads())
    return out, res


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotate-half RoPE of x [T, H, D] (rows any stride apart, heads contiguous) by cos/sin [T, 1, D], by
    the C kernel; None where it does not take these tensors."""
    if library() is None or x.dim() != 3 or cos.dim() != 3:
        return None
    t, hn, d = x.shape
    if d % 2 or x.stride(2) != 1 or x.stride(1) != d or cos.shape != (t, 1, d) or sin.shape != (t, 1, d) \
            or not _plain(cos, sin) or x.dtype != _F32 or not x.is_cpu:
        return None
    out = _empty(t, hn, d, dtype=torch.float32, device=x.device)
    _kernel.rope_f32(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t, hn, d)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [T, 2I] (gate first) by the C kernel; None where it does not take it."""
    if library() is None or gate_up.dim() != 2 or gate_up.shape[1] % 2 or not _plain(gate_up):
        return None
    t, i2 = gate_up.shape
    out = _empty(t, i2 // 2, dtype=torch.float32, device=gate_up.device)
    _kernel.silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), t, i2 // 2, torch.get_num_threads())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """The index of each row's largest value for x [N, V] (the first of equal ones; the first NaN where a row has
    one: as x.max(dim=-1).indices), by the C kernel; None where it does not take x."""
    if library() is None or x.dim() != 2 or not _plain(x) or not 0 < x.shape[1] < 1 << 31:
        return None
    out = _empty(x.shape[0], dtype=torch.int64, device=x.device)
    _kernel.argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


# ggml type id -> bytes per block of 32 weights, for the types the quantized kernels read (reference.BLOCK_BYTES).
_Q_BLOCK_BYTES = {3: 20, 8: 34}


def q_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int, gated: bool = False) -> torch.Tensor | None:
    """x [M, K] @ w^T for a weight w [N, K] kept in GGUF's blocks (blocks: uint8 [N, K / 32 * block bytes] of ggml
    type `qtype`, Q8_0 or Q4_1), each block dequantized in registers by the C kernel; gated: w is a gate/up
    projection [2I, K] (gate rows first) and the result silu(gate) * up [M, I]. None where it does not take
    these tensors (the op runs its reference). Below the C kernel's tiled rows (decode's few rows) it reads the
    blocks' repack (q_repacked), the same bits faster; from its panel rows (a decode batch of 8-16 rows or more,
    a prompt) their panel repack (q_prepacked), the bits of its panels over the blocks without their transposes."""
    size = _Q_BLOCK_BYTES.get(qtype)
    if size is None or (_kernel is None and library() is None) or x.dim() != 2 or x.dtype != _F32 \
            or not x.is_cpu or blocks.dtype != _U8 or blocks.dim() != 2 or not blocks.is_cpu \
            or not blocks.is_contiguous():
        return None
    m, k = x.shape
    n, width = blocks.shape
    if k % 32 or width != k // 32 * size or (gated and n % 2):
        return None
    x = x.contiguous()
    if gated:
        n //= 2
    y = _empty(m, n, dtype=_F32, device=x.device)   # never torch's default device
    threads = torch.get_num_threads()
    if m < _kernel.tiled_rows:
        rp = q_repacked(blocks, qtype, k)
        if rp is not None and not _kernel.q_linear_repacked_f32(x.data_ptr(), rp.data_ptr(), y.data_ptr(), m, n, k,
                                                                 qtype, int(gated), threads):
            return y
    elif m >= _kernel.prep_rows[gated]:
        rp = q_prepacked(blocks, qtype, k)
        if rp is not None and not _kernel.q_linear_prepacked_f32(x.data_ptr(), rp.data_ptr(), y.data_ptr(), m, n, k,
                                                                  qtype, int(gated), threads):
            return y
    if _kernel.q_linear_f32(x.data_ptr(), blocks.data_ptr(), y.data_ptr(), m, n, k, qtype, int(gated), threads):
        return None
    return y


# Repacks of quantized weights (q_repacked): id(blocks) -> (a weak reference to them, their version and storage, the
# repack), as _packs.
_repacks: dict[int, tuple] = {}


def q_repacked(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor | None:
    """The repack of `blocks` (a quantized weight [N, K], checked by the caller) that the C kernel reads at decode's
    rows: per group of rows and block, the scales as floats, then the payloads (native.c, q_repack_f32): the same
    weights, about a fifth more bytes, read as one stream. Made on first use and again once the blocks change, as
    packed_weight; the blocks stay the weight (the reference, the other row counts and every hook read them)."""
    return _repack(_repacks, "q_repack", blocks, qtype, k)


# Panel repacks of quantized weights (q_prepacked), as _repacks.
_prepacks: dict[int, tuple] = {}


def q_prepacked(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor | None:
    """The panel repack of `blocks` that the C kernel reads from its panel rows (native.c, q_prepack_f32): per panel
    of output rows and block, the rows' scales as floats, then their payloads k-major, so that a panel of weights
    dequantizes without transposes; about a fifth more bytes than the blocks. Kept as q_repacked's."""
    return _repack(_prepacks, "q_prepack", blocks, qtype, k)


def _repack(cache: dict[int, tuple], kind: str, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor | None:
    """cache's repack of `blocks` by the C kernel's `kind`_bytes and `kind`_f32: made on first use and again once
    the blocks change (their version or storage), forgotten with them."""
    entry = cache.get(id(blocks))
    if entry is not None and entry[0]() is blocks and entry[1] == blocks._version and entry[2] == blocks.data_ptr():
        return entry[3]
    if library() is None:
        return None
    size = getattr(_kernel, f"{kind}_bytes")(blocks.shape[0], k, qtype)
    if size <= 0:
        return None
    rp = _empty(size, dtype=torch.uint8, device=blocks.device)
    getattr(_kernel, f"{kind}_f32")(blocks.data_ptr(), rp.data_ptr(), blocks.shape[0], k, qtype,
                                    torch.get_num_threads())
    cache[id(blocks)] = (weakref.ref(blocks, _forget(cache, id(blocks))), blocks._version, blocks.data_ptr(), rp)
    return rp


def q_embedding(ids: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor | None:
    """The rows `ids` (int64, any shape) of an embedding table kept in GGUF's blocks (uint8 [V, H / 32 * block
    bytes] of ggml type `qtype`), dequantized by the C kernel: float32 [*ids.shape, H], the reference's bits. None
    where it does not take these tensors (the op runs its reference); an id outside the table is an IndexError, as
    the reference's index_select raises."""
    size = _Q_BLOCK_BYTES.get(qtype)
    if size is None or library() is None or ids.dtype != torch.int64 or not ids.is_cpu \
            or blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_cpu or not blocks.is_contiguous() \
            or blocks.shape[1] % size:
        return None
    flat = ids.reshape(-1).contiguous()
    h = blocks.shape[1] // size * 32
    out = _empty(*ids.shape, h, dtype=torch.float32, device=blocks.device)
    rc = _kernel.q_rows_f32(blocks.data_ptr(), flat.data_ptr(), out.data_ptr(), flat.numel(), blocks.shape[0], h,
                            qtype)
    if rc == -2:
        raise IndexError(f"an id of {flat.tolist()} is outside the embedding's {blocks.shape[0]} rows")
    return out if rc == 0 else None

