"""The collective ledger: every collective and point-to-point op a rank makes, in a ring in shared memory.

A collectives observer (distributed/collectives.py) enters each op as it is issued: per process group a
collective sequence number and a p2p sequence number (as PyTorch's Flight Recorder counts them), the op, the
group, input and output shapes and dtypes, where in the step (step, layer, site), and its times: created
(scheduled), started, completed. Completion comes from the op itself: a blocking call's return on gloo, or its
Work where there is one (an `async_op=True` call; any op on NCCL, whose blocking calls return once the op is
queued), never from the caller moving on. Always on; read from outside
(the hang detector, /debug, bundles) while the rank is paused or hung, like the worker state (state.py).

The file: a header (magic, capacity, count, the length of the groups' description, then that description as
JSON), then `capacity` fixed-size entries. The writer fills entry `count % capacity` whole, then publishes
`count + 1`; an entry's started and completed times are later single aligned 8-byte stores. A reader copies
the newest entries and takes them only if the writer did not meanwhile reach the oldest of them.
"""
from __future__ import annotations

import json
import struct
import threading
import time
from pathlib import Path

from devharness.debug.board import _close, _map
from devharness.protocol.messages import Ledger, LedgerEntry, LedgerGroup

CAPACITY = 4096                      # entries a rank keeps (tiny-llama at tp=2 makes 10 a step)
OPS = ("all_reduce", "all_gather", "send", "recv")
P2P = ("send", "recv")
OP_INDEX = {op: i for i, op in enumerate(OPS)}
DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
DTYPE_INDEX = {d: i for i, d in enumerate(DTYPES)}
MAX_DIMS = 4
POLL_S = 0.005                       # how often a CUDA op's completion is looked at
SITE_BYTES = 40

_MAGIC = 0x3152474445444C   # "LDEDGR1"
_HEAD = struct.Struct("<QQQQ")       # magic, capacity, count, length of the groups' JSON
_COUNT_WORD = 2
_META_AT, _ENTRIES_AT = _HEAD.size, 4096
# created, started, completed (ns); collective seq, p2p seq, step; layer, peer, group; op, dtypes, ndims, site
# length; shapes; site. 120 bytes: a multiple of 8, so every entry's times are aligned words.
_ENTRY = struct.Struct(f"<qqqIIIhhhBBBBBB{MAX_DIMS}i{MAX_DIMS}i{SITE_BYTES}s")
_WORDS = _ENTRY.size // 8
_STARTED, _COMPLETED = 1, 2          # word offsets of those times in an entry
assert _ENTRY.size % 8 == 0


def ledger_path(run_id: str, rank: int) -> Path:
    from devharness.debug.state import STATE_DIR
    return STATE_DIR / f"devharness-{run_id}-rank{rank}.collectives"


class CollectiveLedger:
    """The worker's side: a collectives observer (its on_call / on_done) that enters every op in the ring.

    `recorder` is the worker's StateRecorder: the step and layer an op is made in are read from it."""

    layer = None

    def __init__(self, run_id: str, rank: int, groups, recorder, backend: str = "gloo", async_ops: bool = False,
                 capacity: int = CAPACITY):
        self.rank, self.recorder, self.capacity = rank, recorder, capacity
        self._polls = backend == "nccl"   # a Work's future completes once the op is queued: poll the Work
        self.path = ledger_path(run_id, rank)
        self._mm = _map(self.path, _ENTRIES_AT + capacity * _ENTRY.size, create=True)
        self._words = memoryview(self._mm).cast("q")
        self._base = _ENTRIES_AT // 8
        meta = json.dumps({"rank": rank, "backend": backend, "async_ops": async_ops,
                           "groups": [{"name": g.name, "desc": g.desc, "ranks": list(g.ranks)} for g in groups]})
        data = meta.encode()
        if len(data) > _ENTRIES_AT - _META_AT:
            raise ValueError(f"collective ledger: {len(data)} bytes of groups do not fit its header")
        self._mm[_META_AT:_META_AT + len(data)] = data
        _HEAD.pack_into(self._mm, 0, _MAGIC, capacity, 0, len(data))
        self.count = 0
        self._pending: list = []           # CUDA: (entry, Work) not completed yet, polled by a thread
        self._pending_lock = threading.Lock()
        self._poller: threading.Thread | None = None
        self._closed = False
        self._dtypes: dict = {}            # torch dtype -> its code
        self._sites: dict[str, bytes] = {}
        self._coll = [0] * len(groups)     # per group: the last collective sequence number given
        self._p2p = [0] * len(groups)

    # -- the observer -----------------------------------------------------------------------------

    def on_call(self, call) -> None:
        """Before the op runs (a planted fault has had its say: a skipped op is not made, so not entered). A few
        times a layer: written out flat, with the site's bytes and the dtype's code looked up once."""
        if call.skip:
            return
        g = call.group
        if call.op in P2P:
            self._p2p[g] = p2p = self._p2p[g] + 1
            coll = self._coll[g]
        else:
            self._coll[g] = coll = self._coll[g] + 1
            p2p = self._p2p[g]
        t = call.tensor
        shape = t.shape
        out = call.out_shape if call.out_shape is not None else shape
        dtype = self._dtypes.get(t.dtype)
        if dtype is None:
            dtype = self._dtypes[t.dtype] = DTYPE_INDEX.get(str(t.dtype)[6:], 255)
        site = self._sites.get(call.site)
        if site is None:
            site = self._sites[call.site] = call.site.encode()[:SITE_BYTES]
        rec = self.recorder
        layer = rec.layer
        now = time.time_ns()
        index = self.count
        n_in, n_out = min(len(shape), MAX_DIMS), min(len(out), MAX_DIMS)
        _ENTRY.pack_into(self._mm, _ENTRIES_AT + (index % self.capacity) * _ENTRY.size, now, now, 0, coll, p2p,
                         rec.state.step, -1 if layer is None else layer, -1 if call.peer is None else call.peer, g,
                         OP_INDEX[call.op], dtype, dtype, n_in, n_out, len(site), *(*shape, 0, 0, 0, 0)[:MAX_DIMS],
                         *(*out, 0, 0, 0, 0)[:MAX_DIMS], site)
        self.count = index + 1
        self._words[_COUNT_WORD] = index + 1
        call.entry = index

    def on_done(self, call) -> None:
        """The op returned to the caller: completed if it blocked without a Work (gloo); an op with a Work (async,
        or any on NCCL, where even a blocking call returns once the op is queued) completes when its Work does. On
        gloo the Work's future says so; on NCCL the future completes once the op is queued, so the Work's own
        completion (its end event, as Flight Recorder reads it) is polled instead."""
        index = call.entry
        if index is None:
            return
        work = call.work
        if work is None:   # completed(index), written out: the first code after a blocking op's wait
            self._words[self._base + (index % self.capacity) * _WORDS + _COMPLETED] = time.time_ns()
        elif self._polls:
            with self._pending_lock:
                self._pending.append((index, work))
                if self._poller is None:
                    self._poller = threading.Thread(target=self._poll, name="devharness-ledger", daemon=True)
                    self._poller.start()
        else:
            work.get_future().then(lambda f, i=index: self._future_done(f, i))

    def _future_done(self, future, index: int) -> None:
        try:
            future.value()   # raises what the op failed with (a peer gone): that one never completed
        except Exception:
            return
        self.completed(index)

    def _poll(self) -> None:
        while not self._closed:
            with self._pending_lock:
                pending, self._pending = self._pending, []
            still = []
            for index, work in pending:
                try:
                    done = work.is_completed()
                except Exception:   # failed or aborted: it will not complete
                    done = False
                    continue
                if done:
                    self.completed(index)
                else:
                    still.append((index, work))
            if still:
                with self._pending_lock:
                    self._pending[:0] = still
            time.sleep(POLL_S)

    def completed(self, index: int) -> None:
        if self.count - index <= self.capacity:   # still in the ring
            self._words[self._base + (index % self.capacity) * _WORDS + _COMPLETED] = time.time_ns()

    def close(self) -> None:
        self._closed = True
        if self._poller is not None:
            self._poller.join(1.0)
        self._words.release()
        _close(self._mm, self.path)


def _read_entries(mm, capacity: int, groups: list[LedgerGroup], first: int, count: int) -> list[LedgerEntry]:
    out = []
    for index in range(first, count):
        (created, started, completed, coll, p2p, step, layer, peer, g, op, in_dt, out_dt, n_in, n_out, n_site,
         *rest) = _ENTRY.unpack_from(mm, _ENTRIES_AT + (index % capacity) * _ENTRY.size)
        in_shape, out_shape, site = rest[:MAX_DIMS], rest[MAX_DIMS:2 * MAX_DIMS], rest[2 * MAX_DIMS]
        state = "completed" if completed else "started" if started else "scheduled"
        out.append(LedgerEntry(
            record_id=index, group=groups[g].name if g < len(groups) else str(g), op=OPS[op], collective_seq=coll,
            p2p_seq=p2p, peer=None if peer < 0 else peer, step=step, layer=None if layer < 0 else layer,
            site=site[:n_site].decode(errors="replace"), in_shape=list(in_shape[:n_in]),
            in_dtype=DTYPES[in_dt] if in_dt < len(DTYPES) else "?", out_shape=list(out_shape[:n_out]),
            out_dtype=DTYPES[out_dt] if out_dt < len(DTYPES) else "?", state=state, created_ns=created,
            started_ns=started, completed_ns=completed))
    return out


class LedgerReader:
    """The driver's side: one rank's ledger, read from its file (a restarted worker's new file is followed)."""

    def __init__(self, run_id: str, rank: int):
        self.rank, self.path = rank, ledger_path(run_id, rank)
        self._mm = None
        self._inode = None
        self._meta: dict | None = None

    def _open(self) -> bool:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            st = None
        if self._mm is not None and (st is None or st.st_ino != self._inode):
            _close(self._mm, None)
            self._mm = self._meta = None
        if self._mm is None and st is not None and st.st_size > _ENTRIES_AT:
            self._mm, self._inode = _map(self.path, None, create=False), st.st_ino
        return self._mm is not None

    def read(self, last: int | None = None) -> Ledger | None:
        """The ledger now (its newest `last` entries, or all the ring holds); None before the worker made it."""
        if not self._open():
            return None
        mm = self._mm
        magic, capacity, _, meta_len = _HEAD.unpack_from(mm, 0)
        if magic != _MAGIC:
            return None
        if self._meta is None:
            self._meta = json.loads(bytes(mm[_META_AT:_META_AT + meta_len]))
        meta = self._meta
        groups = [LedgerGroup(g["name"], g["desc"], g["ranks"]) for g in meta["groups"]]
        keep = capacity - 1 if last is None else min(last, capacity - 1)
        for _ in range(100):
            count = _HEAD.unpack_from(mm, 0)[2]
            first = max(0, count - keep)
            entries = _read_entries(mm, capacity, groups, first, count)
            # The writer fills entry `count` next: if it went past the oldest slot read, read again.
            if _HEAD.unpack_from(mm, 0)[2] - first < capacity:
                return Ledger(rank=meta["rank"], backend=meta["backend"], async_ops=meta["async_ops"], groups=groups,
                              entries=entries, count=count, capacity=capacity)
        return None

    def close(self) -> None:
        if self._mm is not None:
            _close(self._mm, None)
            self._mm = None


def read_ledger(run_id: str, rank: int, last: int | None = None) -> Ledger | None:
    reader = LedgerReader(run_id, rank)
    try:
        return reader.read(last)
    finally:
        reader.close()
