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


class StateBoard:
    """A shared-memory file with two slots; one writer, any number of readers (a seqlock)."""

    def __init__(self, path: Path, size: int, create: bool):
        self.path = Path(path)
        self.size = size
        self._slot = (size - _HEADER.size) // 2
        if create:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(fd, size)
        else:
            fd = os.open(self.path, os.O_RDONLY)
        try:
            self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if create else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self._seq = 0
        self._lens = [0, 0]

    def write(self, data: bytes) -> None:
        if len(data) > self._slot:
            data = data[:0]   # an oversized record is dropped rather than torn; callers keep records small
        slot = (self._seq + 1) % 2
        start = _HEADER.size + slot * self._slot
        self._mm[start:start + len(data)] = data
        self._lens[slot] = len(data)
        self._seq += 1
        _HEADER.pack_into(self._mm, 0, self._seq, *self._lens)

    def read(self) -> bytes | None:
        for _ in range(100):
            seq, len0, len1 = _HEADER.unpack_from(self._mm, 0)
            if seq == 0:
                return None
            slot = seq % 2
            start = _HEADER.size + slot * self._slot
            data = self._mm[start:start + (len0, len1)[slot]]
            # After publishing seq the writer fills the other slot, then ours again after seq + 1:
            # the copy is whole only if nothing was published while it was taken.
            if _HEADER.unpack_from(self._mm, 0)[0] == seq:
                return data
        return None

    def close(self, unlink: bool = False) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass
        if unlink:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass


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
_history_decoder = msgspec.msgpack.Decoder(list[StepRecord])


class StateRecorder:
    """The worker side: phase changes, step boundaries and pauses, each published at once."""

    def __init__(self, state: WorkerState, run_id: str, history_len: int = 64):
        self.state = state
        state_path, history_path = board_paths(run_id, state.rank)
        self._board = StateBoard(state_path, 8192, create=True)
        self._history_board = StateBoard(history_path, 1 << 16, create=True)
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
        if self._step_start:
            self._phase_ms[st.phase] = self._phase_ms.get(st.phase, 0.0) + (now - st.phase_since) * 1000
        st.phase, st.detail, st.phase_since, st.waiting_for = phase, detail, now, waiting_for
        st.paused = None   # any progress ends a pause
        self.publish()

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
        self.history.append(StepRecord(st.step, self._phase_ms, st.last_step_ms, st.num_tokens))
        self._step_start = 0.0
        self._history_board.write(_encoder.encode(list(self.history)))
        st.phase, st.detail, st.phase_since, st.waiting_for, st.paused = "idle", "", now, None, None
        self.publish()

    def set_paused(self, reason: str, file: str, line: int) -> None:
        self.state.paused = PausedInfo(reason, file, line, time.time())
        self.publish()

    def close(self) -> None:
        self._board.close(unlink=True)
        self._history_board.close(unlink=True)


class StateReader:
    """The driver side: the latest state and step history of one worker, read from its files."""

    def __init__(self, run_id: str, rank: int):
        self.rank = rank
        self._paths = board_paths(run_id, rank)
        self._boards: list[StateBoard | None] = [None, None]

    def _board(self, i: int) -> StateBoard | None:
        if self._boards[i] is None and self._paths[i].exists():
            size = self._paths[i].stat().st_size
            if size:
                self._boards[i] = StateBoard(self._paths[i], size, create=False)
        return self._boards[i]

    def state(self) -> WorkerState | None:
        board = self._board(0)
        data = board.read() if board else None
        return _state_decoder.decode(data) if data else None

    def history(self) -> list[StepRecord]:
        board = self._board(1)
        data = board.read() if board else None
        return _history_decoder.decode(data) if data else []

    def close(self) -> None:
        for b in self._boards:
            if b is not None:
                b.close()


# The recorder of this process's worker, if any. One worker per process, set once at worker start.
_recorder: StateRecorder | None = None


def install_recorder(rec: StateRecorder | None) -> None:
    global _recorder
    _recorder = rec


def current_recorder() -> StateRecorder | None:
    return _recorder
