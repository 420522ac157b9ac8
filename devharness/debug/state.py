"""Per-worker step state, published where a reader gets it without the worker's help.

Each worker owns two small files in shared memory (/dev/shm; layout in board.py): its latest
WorkerState and its last steps. A worker paused in a debugger or hung in a collective cannot answer
a call, but what it last published stays readable. Every phase change is published at once: most
of them are one 8-byte store (see `bench debug-overhead` for what that costs a step).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from contextvars import ContextVar
from pathlib import Path

import msgspec

from devharness.debug.board import (LEFT, MAX_SITES, SITE_SHIFT, TIME_SHIFT, WORD_INDEX, Site, StateBoard, StepRing,
                                    pack_word, unpack_word)
from devharness.protocol.messages import PHASES, PausedInfo, StepRecord, WorkerState
from devharness.protocol.frames import state_decoder

STATE_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
PHASE_INDEX = {p: i for i, p in enumerate(PHASES)}


def board_paths(run_id: str, rank: int) -> tuple[Path, Path]:
    """(state file, history file) of one worker of one engine run."""
    base = STATE_DIR / f"devharness-{run_id}-rank{rank}"
    return base.with_name(base.name + ".state"), base.with_name(base.name + ".history")


def release_path(run_id: str, rank: int) -> Path:
    """The file whose appearance tells a worker paused with no debugger attached to go on (POST /debug/release)."""
    return STATE_DIR / f"devharness-{run_id}-rank{rank}.release"


def remove_run_files(run_id: str) -> None:
    for p in STATE_DIR.glob(f"devharness-{run_id}-rank*"):
        try:
            p.unlink()
        except FileNotFoundError:
            pass


_encoder = msgspec.msgpack.Encoder()


def _after(detail: str) -> str:
    return f"after {detail}" if detail else ""


_IDLE, _PREPARE = PHASE_INDEX["idle"], PHASE_INDEX["prepare"]
_now = time.monotonic   # phase times; the step block says which wall time the phase word counts from


def _step_records(rows: list[tuple]) -> list[StepRecord]:
    return [StepRecord(step, {PHASES[i]: s * 1000 for i, s in enumerate(phase_s) if s and i != _IDLE}, total_ms,
                       num_tokens, started_at, started_at + total_ms / 1000)
            for step, num_tokens, started_at, total_ms, *phase_s in rows]


class StateRecorder:
    """The worker side: phase changes, step boundaries and pauses, each published at once.

    `state` holds the record's fields and the step's (step, batch, KV use). The phase (a site, a time,
    whether the worker left the site) lives in the recorder and goes out as the phase word; it is
    copied into `state` when a whole record is written. `snapshot()` is what a reader sees.

    Only the worker's thread changes phases and steps. The debugger's watcher thread may publish the
    record meanwhile (client attached, stopped at a breakpoint); `phase_key()` tells it whether the
    worker moved on while it did."""

    # Slots: the hot path reads a handful of these right after a collective's wait, on cold caches,
    # and slots keep them in the object itself rather than in a dict beside it.
    __slots__ = ("state", "layer", "release_path", "_board", "_ring", "_words", "_sites", "_site_of", "_site_phase",
                 "_site_ret", "_site", "_phase", "_since", "_left", "_base", "_wall_base", "_step_start", "_acc", "_lock",
                 "_mono_to_wall")

    def __init__(self, state: WorkerState, run_id: str, history_len: int = 64):
        self.state = state
        state_path, history_path = board_paths(run_id, state.rank)
        self._board = StateBoard(state_path, create=True)
        self._ring = StepRing(history_path, len(PHASES), history_len + 1, create=True)
        self.release_path = release_path(run_id, state.rank)
        self._words = self._board.words
        self.layer: int | None = None          # the decoder layer running now (for details and breakpoints)
        # Sites 0.. are the plain phases (no detail, no peers); the rest are added as they are first met.
        self._sites: list[Site] = []
        self._site_of: dict[tuple, int] = {}   # (phase, what, layer, phase now) -> site
        self._site_phase: list[int] = []       # per site: its phase, and the phase after leaving it
        self._site_ret: list[int] = []
        for i in range(len(PHASES)):
            self._add_site(i, "", None, i)
        self._site, self._phase, self._since, self._left = _IDLE, _IDLE, _now(), False
        self._base, self._wall_base = self._since, time.time()
        # Wall times of step starts come from the monotonic clock and this offset, taken once: a step's start and
        # its length then come from one clock, so the steps a rank runs one after another never overlap in a trace
        # (read beside each other, a thread preempted between the two clocks gave a start later than the step's).
        self._mono_to_wall = self._wall_base - self._since
        self._step_start = 0.0
        self._acc = [0.0] * len(PHASES)        # seconds in each phase during this step
        self._lock = threading.Lock()          # whole records have one writer at a time
        self._write_step()
        self.publish()

    def _add_site(self, phase: int, detail: str, waits: list[int] | None, ret: int) -> int:
        if len(self._sites) >= MAX_SITES:   # table full: the plain phase, without its detail
            return phase
        self._sites.append(Site(phase, ret, detail, tuple(waits) if waits else None))
        self._site_phase.append(phase)
        self._site_ret.append(ret)
        self._board.add_site(len(self._sites) - 1, self._sites[-1])
        return len(self._sites) - 1

    # -- what it says ------------------------------------------------------------------------

    def _fill(self, st: WorkerState) -> None:
        site = self._sites[self._site]
        st.phase, st.phase_since = PHASES[self._phase], self._wall_base + (self._since - self._base)
        st.detail = _after(site.detail) if self._left else site.detail
        st.waiting_for = None if self._left or not site.waiting_for else list(site.waiting_for)

    def snapshot(self) -> WorkerState:
        st = msgspec.structs.replace(self.state)
        self._fill(st)
        return st

    def history(self) -> list[StepRecord]:
        return _step_records(self._ring.read())

    def publish(self) -> None:
        """Write the whole record, and the phase word again (see phase_key)."""
        with self._lock:
            self._fill(self.state)
            self._board.write_record(_encoder.encode(self.state))
            self._words[WORD_INDEX] = self._word()

    def phase_key(self) -> tuple:
        """Changes whenever the phase does."""
        return self._site, self._since, self._left

    def _word(self) -> int:
        return pack_word(self._since - self._base, self._site, self._left)

    def _write_step(self) -> None:
        st = self.state
        self._board.write_step(st.step, st.num_reqs, st.num_tokens, st.kv_blocks_used, st.last_step_ms,
                               self._wall_base, self._word())

    # -- the hot path: a few times a layer ------------------------------------------------------

    def set_phase(self, phase: str, detail: str = "", waiting_for: list[int] | None = None) -> None:
        self.enter(phase, detail, waiting_for)

    def enter(self, phase: str, what: str, waiting_for: list[int] | None = None, layer: int | None = None) -> None:
        """A new phase: `what` (in `layer`, if given), waiting for the ranks in `waiting_for` (the same
        ones each time a site is met). The first time a site is met it goes into the table; after that
        this is a dict lookup and one store."""
        site = self._site_of.get((phase, what, layer, self._phase))
        if site is None:
            detail = f"layer {layer} {what}" if layer is not None else what
            site = self._site_of[(phase, what, layer, self._phase)] = \
                self._add_site(PHASE_INDEX[phase], detail, waiting_for, self._phase)
        now = _now()
        self._acc[self._phase] += now - self._since
        self._site, self._phase, self._since, self._left = site, self._site_phase[site], now, False
        if self.state.paused is not None:   # any progress ends a pause: the whole record changes
            self.state.paused = None
            self.publish()
            return
        # pack_word(now - self._base, site, False), written out: a call less on the hot path
        self._words[WORD_INDEX] = (int((now - self._base) * 1e6) << TIME_SHIFT) | (site << SITE_SHIFT)

    def leave(self) -> None:
        """Back to the phase before enter(): the first code after a collective's wait, so it is short."""
        now = _now()   # then pack_word(now - self._base, self._site, True), written out
        self._words[WORD_INDEX] = (int((now - self._base) * 1e6) << TIME_SHIFT) | (self._site << SITE_SHIFT) | LEFT
        self._acc[self._phase] += now - self._since
        self._phase, self._since, self._left = self._site_ret[self._site], now, True

    # -- step boundaries and pauses --------------------------------------------------------------

    def begin_step(self, step: int, num_reqs: int, num_tokens: int) -> None:
        st = self.state
        st.step, st.num_reqs, st.num_tokens = step, num_reqs, num_tokens
        self._acc = [0.0] * len(PHASES)
        # Idle time between steps is not the step's. The phase word counts from here (so a wall-clock
        # change never shows in a step's times): it says "prepare, 0 us".
        self._step_start = self._since = self._base = _now()
        self._wall_base = wall = self._step_start + self._mono_to_wall
        self._site = self._phase = _PREPARE
        self._left = False
        self._board.write_step(step, num_reqs, num_tokens, st.kv_blocks_used, st.last_step_ms, wall,
                               pack_word(0.0, _PREPARE, False))
        if st.paused is not None:
            st.paused = None
            self.publish()

    def end_step(self) -> None:
        now = _now()
        st = self.state
        acc = self._acc
        acc[self._phase] += now - self._since
        acc[_IDLE] = 0.0
        st.last_step_ms = ms = (now - self._step_start) * 1000
        self._ring.append(st.step, st.num_tokens, self._wall_base, ms, acc)
        self._step_start = 0.0
        self._site = self._phase = _IDLE
        self._since, self._left = now, False
        self._board.write_step(st.step, st.num_reqs, st.num_tokens, st.kv_blocks_used, ms, self._wall_base,
                               pack_word(now - self._base, _IDLE, False))
        if st.paused is not None:
            st.paused = None
            self.publish()

    def set_batch(self, step: int, num_reqs: int, num_tokens: int, kv_blocks_used: int,
                  kv_blocks_total: int) -> None:
        """Outside a step (a step with nothing to run, the KV cache allocated): the whole record."""
        st = self.state
        st.step, st.num_reqs, st.num_tokens = step, num_reqs, num_tokens
        st.kv_blocks_used, st.kv_blocks_total = kv_blocks_used, kv_blocks_total
        self._write_step()
        self.publish()

    def set_paused(self, reason: str, file: str, line: int) -> None:
        self.state.paused = PausedInfo(reason, file, line, time.time())
        self.publish()

    def clear_paused(self) -> None:
        self.state.paused = None
        self.publish()

    def close(self) -> None:
        self._board.close(unlink=True)
        self._ring.close(unlink=True)


class StateReader:
    """The driver side: the latest state and step history of one worker, read from its files."""

    def __init__(self, run_id: str, rank: int):
        self.rank = rank
        self._paths = board_paths(run_id, rank)
        self._board: StateBoard | None = None
        self._ring: StepRing | None = None
        self._inodes = [None, None]

    def _follow(self, kind: int, opened, open_file):
        """The file `kind` (0 state, 1 history) as mapped now: a restarted worker makes new files under the
        same names (the old maps stay readable, but show the dead worker), so a new inode is opened anew."""
        try:
            st = self._paths[kind].stat()
        except FileNotFoundError:
            st = None
        if opened is not None and (st is None or st.st_ino != self._inodes[kind]):
            opened.close()
            opened = None
        if opened is None and st is not None and st.st_size:
            opened, self._inodes[kind] = open_file(self._paths[kind]), st.st_ino
        return opened

    def state(self) -> WorkerState | None:
        self._board = self._follow(0, self._board, lambda p: StateBoard(p, create=False))
        got = self._board.read() if self._board else None
        if not got:
            return None
        data, block, word, site = got
        st = state_decoder.decode(data)
        st.step, st.num_reqs, st.num_tokens = block.step, block.num_reqs, block.num_tokens
        st.kv_blocks_used, st.last_step_ms = block.kv_blocks_used, block.last_step_ms
        since, _, left = unpack_word(word)
        st.phase_since = block.base + since
        if left:
            st.phase, st.detail, st.waiting_for = PHASES[site.ret], _after(site.detail), None
        else:
            st.phase, st.detail = PHASES[site.phase], site.detail
            st.waiting_for = list(site.waiting_for) if site.waiting_for else None
        return st

    def history(self) -> list[StepRecord]:
        self._ring = self._follow(1, self._ring, lambda p: StepRing(p, len(PHASES)))
        return _step_records(self._ring.read()) if self._ring else []

    def close(self) -> None:
        for b in (self._board, self._ring):
            if b is not None:
                b.close()


# The recorder of the worker whose step runs in this thread: set by that worker around each of its calls that
# publish (scope), reset in finally, so that two workers in one process (two engines) never publish to each
# other's files. A thread of the worker's own (the debugger's watcher) is handed the recorder instead.
_current: ContextVar[StateRecorder | None] = ContextVar("devharness_recorder", default=None)


@contextlib.contextmanager
def scope(rec: StateRecorder | None):
    token = _current.set(rec)
    try:
        yield rec
    finally:
        _current.reset(token)


def current_recorder() -> StateRecorder | None:
    return _current.get()
