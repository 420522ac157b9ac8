"""Per-worker step state, published where a reader gets it without the worker's help.

Each worker owns a small file in shared memory (/dev/shm) holding its latest WorkerState,
msgpack-encoded into one of two slots (the reader takes the slot the sequence number points at
and retries if the writer moved on meanwhile). A worker paused in a debugger or hung in a
collective cannot answer a call, but its last state stays readable. Publishing costs about a
microsecond, so every phase change is published.
"""
from __future__ import annotations

import collections
import mmap
import os
import struct
import threading
import time
from pathlib import Path

import msgspec

PHASES = ("idle", "recv", "prepare", "forward", "collective", "sample", "send", "paused", "dead")
STATE_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


class DebugpyInfo(msgspec.Struct):
    host: str
    port: int
    client_connected: bool = False


class PausedInfo(msgspec.Struct):
    reason: str            # "breakpoint" | "exception" | "waiting_for_client"
    file: str
    line: int
    since: float


class WorkerState(msgspec.Struct):
    """What one rank is doing (DESIGN.md §3); `detail` says which layer and collective."""

    rank: int
    tp_rank: int
    pp_rank: int
    node_ip: str
    pid: int
    debugpy: DebugpyInfo | None = None
    step: int = 0
    phase: str = "idle"
    detail: str = ""
    phase_since: float = 0.0
    last_step_ms: float | None = None
    num_reqs: int = 0
    num_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    paused: PausedInfo | None = None
    alive: bool = True
    waiting_for: list[int] | None = None   # ranks this one waits on in its current collective / recv


class StepRecord(msgspec.Struct, array_like=True):
    """One finished step of one worker: time spent in each phase, ms."""

    step: int
    phases: dict[str, float]
    total_ms: float
    num_tokens: int


_HEADER = struct.Struct("<QII")   # sequence number, length of slot 0, length of slot 1
# "Since <time>, the worker whose record is <seq> is in phase <index>, <detail>, waiting for <ranks>":
# entering and leaving a collective (four times a layer) patch the record in place with this
# fixed-size struct instead of encoding a whole new one.
_PATCH = struct.Struct("<QBdB48sB8h")
_PATCH_DETAIL_BYTES, _PATCH_MAX_WAIT = 48, 8
_SLOTS_AT = _HEADER.size + _PATCH.size
PHASE_INDEX = {p: i for i, p in enumerate(PHASES)}


def _map(path: Path, size: int | None, create: bool) -> mmap.mmap:
    """Map a worker's file: created (readable by its owner only) and sized, or opened read-only whole."""
    if create:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, size)
    else:
        fd = os.open(path, os.O_RDONLY)
        size = os.fstat(fd).st_size
    try:
        return mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if create else mmap.ACCESS_READ)
    finally:
        os.close(fd)


def _close(mm: mmap.mmap, unlink_path: Path | None) -> None:
    try:
        mm.close()
    except (BufferError, ValueError):
        pass
    if unlink_path is not None:
        try:
            unlink_path.unlink()
        except FileNotFoundError:
            pass


class StateBoard:
    """A shared-memory file with two slots; one writer, any number of readers (a seqlock)."""

    def __init__(self, path: Path, size: int, create: bool):
        self.path = Path(path)
        self.size = size
        self._slot = (size - _SLOTS_AT) // 2
        self._mm = _map(self.path, size, create)
        self._seq = 0
        self._lens = [0, 0]

    def write(self, data: bytes) -> None:
        if len(data) > self._slot:
            data = data[:0]   # an oversized record is dropped rather than torn; callers keep records small
        slot = (self._seq + 1) % 2
        start = _SLOTS_AT + slot * self._slot
        self._mm[start:start + len(data)] = data
        self._lens[slot] = len(data)
        self._seq += 1
        _HEADER.pack_into(self._mm, 0, self._seq, *self._lens)

    def patch(self, phase_index: int, when: float, detail: bytes, waiting_for: list[int]) -> None:
        waits = waiting_for[:_PATCH_MAX_WAIT]
        _PATCH.pack_into(self._mm, _HEADER.size, self._seq, phase_index, when, min(len(detail), _PATCH_DETAIL_BYTES),
                         detail, len(waits), *waits, *([0] * (_PATCH_MAX_WAIT - len(waits))))

    def read(self) -> tuple[bytes, tuple | None] | None:
        """(latest record, (phase index, time, detail, waiting_for) if the record was patched since)."""
        for _ in range(100):
            seq, len0, len1 = _HEADER.unpack_from(self._mm, 0)
            if seq == 0:
                return None
            slot = seq % 2
            start = _SLOTS_AT + slot * self._slot
            data = self._mm[start:start + (len0, len1)[slot]]
            patch = _PATCH.unpack_from(self._mm, _HEADER.size)
            # After publishing seq the writer fills the other slot, then ours again after seq + 1:
            # the copy is whole only if nothing was published (or patched) while it was taken.
            if _HEADER.unpack_from(self._mm, 0)[0] == seq and _PATCH.unpack_from(self._mm, _HEADER.size) == patch:
                if patch[0] != seq:
                    return data, None
                _, index, when, n, detail, n_wait, *waits = patch
                return data, (index, when, detail[:n].decode(errors="replace"), list(waits[:n_wait]) or None)
        return None

    def close(self, unlink: bool = False) -> None:
        _close(self._mm, self.path if unlink else None)


class RecordRing:
    """The last `num_slots` step records in a shared-memory file: each step writes only its own
    record (a couple of microseconds), never the whole history."""

    _COUNT = struct.Struct("<Q")
    _LEN = struct.Struct("<H")

    def __init__(self, path: Path, num_slots: int, slot_bytes: int, create: bool):
        self.path, self.num_slots, self.slot_bytes = Path(path), num_slots, slot_bytes
        self._mm = _map(self.path, self._COUNT.size + num_slots * slot_bytes if create else None, create)
        if not create:
            self.num_slots = (len(self._mm) - self._COUNT.size) // slot_bytes
        self._count = 0

    def append(self, record: bytes) -> None:
        if len(record) + self._LEN.size > self.slot_bytes:
            return
        start = self._COUNT.size + (self._count % self.num_slots) * self.slot_bytes
        self._LEN.pack_into(self._mm, start, len(record))
        self._mm[start + self._LEN.size:start + self._LEN.size + len(record)] = record
        self._count += 1
        self._COUNT.pack_into(self._mm, 0, self._count)

    def read(self) -> list[bytes]:
        """Oldest first. The slot the writer fills next may be mid-write, so it is never returned."""
        for _ in range(100):
            count = self._COUNT.unpack_from(self._mm, 0)[0]
            first = max(0, count - (self.num_slots - 1))
            out = []
            for i in range(first, count):
                start = self._COUNT.size + (i % self.num_slots) * self.slot_bytes
                n = self._LEN.unpack_from(self._mm, start)[0]
                out.append(self._mm[start + self._LEN.size:start + self._LEN.size + n])
            # A new record may have begun overwriting the oldest slot read: then read again.
            if self._COUNT.unpack_from(self._mm, 0)[0] == count:
                return out
        return []

    def close(self, unlink: bool = False) -> None:
        _close(self._mm, self.path if unlink else None)


def board_paths(run_id: str, rank: int) -> tuple[Path, Path]:
    """(state file, history file) of one worker of one engine run."""
    base = STATE_DIR / f"devharness-{run_id}-rank{rank}"
    return base.with_name(base.name + ".state"), base.with_name(base.name + ".history")


def remove_run_files(run_id: str) -> None:
    for p in STATE_DIR.glob(f"devharness-{run_id}-rank*"):
        try:
            p.unlink()
        except FileNotFoundError:
            pass


_encoder = msgspec.msgpack.Encoder()
_state_decoder = msgspec.msgpack.Decoder(WorkerState)
_record_decoder = msgspec.msgpack.Decoder(StepRecord)


def _after(detail: str) -> str:
    return f"after {detail}" if detail else ""


class StateRecorder:
    """The worker side: phase changes, step boundaries and pauses, each published at once."""

    def __init__(self, state: WorkerState, run_id: str, history_len: int = 64):
        self.state = state
        state_path, history_path = board_paths(run_id, state.rank)
        self._board = StateBoard(state_path, 8192, create=True)
        self._history_ring = RecordRing(history_path, history_len + 1, 256, create=True)
        self.history: collections.deque[StepRecord] = collections.deque(maxlen=history_len)
        self._step_start = 0.0
        self._phase_ms: dict[str, float] = {}
        self.layer: int | None = None          # the decoder layer running now (for details and breakpoints)
        self._publish_lock = threading.Lock()
        self.set_phase("idle")

    def publish(self) -> None:
        # The worker's thread and the debugger watcher both publish; the board has one writer at a time.
        with self._publish_lock:
            self._board.write(_encoder.encode(self.state))

    def set_phase(self, phase: str, detail: str = "", waiting_for: list[int] | None = None) -> None:
        now = time.time()
        st = self.state
        if self._step_start and st.phase != "idle":
            self._phase_ms[st.phase] = self._phase_ms.get(st.phase, 0.0) + (now - st.phase_since) * 1000
        st.phase, st.detail, st.phase_since, st.waiting_for = phase, detail, now, waiting_for
        st.paused = None   # any progress ends a pause
        self.publish()

    def enter(self, phase: str, detail: str, waiting_for: list[int] | None) -> None:
        """A collective / send / recv begins: the published record is patched in place (see _PATCH)."""
        if self.state.paused is not None:   # leaving a pause: the whole record changes
            self.set_phase(phase, detail, waiting_for)
            return
        self._patch(phase, detail, waiting_for)

    def leave(self, phase: str) -> None:
        """Back to `phase` after a collective, patched in place like enter()."""
        self._patch(phase, _after(self.state.detail), None)

    def _patch(self, phase: str, detail: str, waiting_for: list[int] | None) -> None:
        now = time.time()
        st = self.state
        if self._step_start and st.phase != "idle":
            self._phase_ms[st.phase] = self._phase_ms.get(st.phase, 0.0) + (now - st.phase_since) * 1000
        st.phase, st.detail, st.phase_since, st.waiting_for = phase, detail, now, waiting_for
        # No lock: a patch names the record it applies to, and readers check it whole.
        self._board.patch(PHASE_INDEX[phase], now, detail.encode(), waiting_for or [])

    def begin_step(self, step: int, num_reqs: int, num_tokens: int) -> None:
        st = self.state
        st.step, st.num_reqs, st.num_tokens = step, num_reqs, num_tokens
        self._phase_ms = {}
        self._step_start = st.phase_since = time.time()   # idle time between steps is not the step's
        self.set_phase("prepare")

    def end_step(self) -> None:
        now = time.time()
        st = self.state
        self._phase_ms[st.phase] = self._phase_ms.get(st.phase, 0.0) + (now - st.phase_since) * 1000
        st.last_step_ms = (now - self._step_start) * 1000
        record = StepRecord(st.step, self._phase_ms, st.last_step_ms, st.num_tokens)
        self.history.append(record)
        self._history_ring.append(_encoder.encode(record))
        self._step_start = 0.0
        st.phase, st.detail, st.phase_since, st.waiting_for, st.paused = "idle", "", now, None, None
        self.publish()

    def set_paused(self, reason: str, file: str, line: int) -> None:
        self.state.paused = PausedInfo(reason, file, line, time.time())
        self.publish()

    def close(self) -> None:
        self._board.close(unlink=True)
        self._history_ring.close(unlink=True)


class StateReader:
    """The driver side: the latest state and step history of one worker, read from its files."""

    def __init__(self, run_id: str, rank: int):
        self.rank = rank
        self._paths = board_paths(run_id, rank)
        self._board: StateBoard | None = None
        self._ring: RecordRing | None = None

    def state(self) -> WorkerState | None:
        if self._board is None and self._paths[0].exists() and self._paths[0].stat().st_size:
            self._board = StateBoard(self._paths[0], self._paths[0].stat().st_size, create=False)
        got = self._board.read() if self._board else None
        if not got:
            return None
        st = _state_decoder.decode(got[0])
        if got[1] is not None:
            index, st.phase_since, st.detail, st.waiting_for = got[1]
            st.phase = PHASES[index]
        return st

    def history(self) -> list[StepRecord]:
        if self._ring is None and self._paths[1].exists() and self._paths[1].stat().st_size:
            self._ring = RecordRing(self._paths[1], 0, 256, create=False)
        return [_record_decoder.decode(r) for r in self._ring.read()] if self._ring else []

    def close(self) -> None:
        for b in (self._board, self._ring):
            if b is not None:
                b.close()


# The recorder of this process's worker, if any. One worker per process, set once at worker start.
_recorder: StateRecorder | None = None


def install_recorder(rec: StateRecorder | None) -> None:
    global _recorder
    _recorder = rec


def current_recorder() -> StateRecorder | None:
    return _recorder


def hang_report(run_id: str, world_size: int, step: int | None = None, now: float | None = None) -> str:
    """Who holds up `step`, from the workers' published states: the ranks that did not arrive
    (still computing, paused, stuck before the step) and the ranks waiting for them in a collective."""
    now = now if now is not None else time.time()
    waiting, holding, unknown = [], [], []
    for rank in range(world_size):
        reader = StateReader(run_id, rank)
        try:
            st = reader.state()
        finally:
            reader.close()
        if st is None:
            unknown.append(str(rank))
            continue
        where = f"{st.phase}{' ' + st.detail if st.detail else ''} for {now - st.phase_since:.0f} s"
        if st.paused is not None:
            where = f"paused ({st.paused.reason}) at {st.paused.file}:{st.paused.line}"
        entry = f"rank {rank} (tp {st.tp_rank}, pp {st.pp_rank}) {where}"
        if st.phase in ("collective", "recv", "send") and st.paused is None:
            waiting.append(entry + (f", waiting for {st.waiting_for}" if st.waiting_for else ""))
        elif st.phase != "idle":
            holding.append(entry)
        elif step is not None and st.step < step:
            holding.append(f"rank {rank} (tp {st.tp_rank}, pp {st.pp_rank}) never started step {step} "
                           f"(last finished step {st.step}, {now - st.phase_since:.0f} s ago)")
    parts = []
    if holding:
        parts.append("did not arrive: " + "; ".join(holding))
    if waiting:
        parts.append("waiting: " + "; ".join(waiting))
    if unknown:
        parts.append(f"no state from rank(s) {', '.join(unknown)} (another node?)")
    return " | ".join(parts) if parts else "every rank is idle"
