"""ShmBroadcast: one writer, many readers, a ring of fixed slots in POSIX shared memory.

The control plane of the mp executor (and of the Ray executor's "shm" mode on one node):
the driver writes each step message once, every worker reads it, no pickle, no syscalls on
the hot path.

Layout of the segment (all counters native uint64, 8-byte aligned, so a store is one
untorn machine write; each counter has exactly one process that writes it):

    reader counters   num_readers lines of 64 bytes: chunks reader i has consumed
    writer counter    one line: chunks written
    slots             num_slots x (32-byte header [seq, nbytes, kind, -] + slot_bytes data)

Chunk k goes to slot k % num_slots and is published by storing seq = k + 1 after its data.
The writer may write chunk k only once every reader has consumed chunk k - num_slots, so an
unread slot is never overwritten and a reader never needs a lock.

Messages larger than `slot_bytes` are split into chunks (a `kind` of last marks the final one) and
reassembled by each reader. `timeout_s` bounds each wait for the readers to free a slot, not the
whole message: a message larger than the ring streams as fast as the slowest reader reads. A write
that gives up delivered nothing: before its first chunk it has written nothing, and once it has
started, the next write first publishes a "withdraw" chunk that makes every reader drop the parts
it holds. So a write that fails may simply be retried, and the channel is never left half-written.
A writer that must not give up on a slow reader (one busy with earlier messages, or paused in a
debugger) passes `on_stall`, called after each `timeout_s` without progress: it raises to give up
(a reader died, a deadline passed) or returns to wait on.

Waiting spins for a few microseconds, then sleeps with a backoff whose cap grows with the
time already waited: steps arrive back to back (short sleeps keep latency low), while an
idle worker wakes only every few milliseconds (cheap on a machine with few cores).

Ownership: the process that `create`s the channel unlinks the segment on `close()` (and at
interpreter exit if it forgot); processes that `attach` only unmap. The creator's segment is
also registered with multiprocessing's resource tracker, which unlinks it if the creator is
killed outright.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

import msgspec

SHM_PREFIX = "devharness_"

_LINE = 64                 # one counter per cache line: readers never share a line
_SLOT_HEADER = 32          # seq, nbytes, kind, unused (uint64 each)
# A chunk's kind: part of a message, its last part, or a withdrawal of the parts so far (a write that gave up).
_PART, _LAST, _WITHDRAW = 0, 1, 2
_SPIN_S = 20e-6
_FIRST_SLEEP_S = 20e-6
# (idle at least, longest single sleep): short sleeps while a message is due any moment, long
# ones once the channel has been idle a while. A reader counts idle time from its last message,
# not from the start of this read, so a loop of read(timeout_s) calls stays cheap when idle.
_SLEEP_CAPS = ((10.0, 10e-3), (1.0, 5e-3), (0.01, 1e-3), (0.0, 100e-6))

_fence_lock = threading.Lock()
_tracker_patch_lock = threading.Lock()


def _fence() -> None:
    # Acquiring and releasing a lock is a full memory barrier. x86 keeps stores (and loads) in
    # order anyway; weaker CPUs (ARM) need it so `seq` is never seen before the data it covers.
    with _fence_lock:
        pass


class ShmHandle(msgspec.Struct, frozen=True):
    """What another process needs to attach: small, picklable and msgspec-encodable."""

    name: str
    num_readers: int
    slot_bytes: int
    num_slots: int


class _Mapping:
    """The mapped segment and the views into it; closed once (by close() or at exit)."""

    def __init__(self, shm: shared_memory.SharedMemory, owner: bool):
        self.shm, self.owner = shm, owner
        self.buf = shm.buf
        self.words = shm.buf.cast("Q")

    def close(self) -> None:
        # Views must be released before the mmap can close (else BufferError).
        if self.words is not None:
            self.words.release()
            self.buf.release()
            self.words = self.buf = None
            self.shm.close()
            if self.owner:
                with contextlib.suppress(FileNotFoundError):
                    self.shm.unlink()


class ShmBroadcast:
    """A one-writer, many-reader message ring; each reader receives every message, in order.

    Writer:  ch = ShmBroadcast.create(num_readers=4)   # this process writes and owns the segment
             pass ch.handle() to the readers (pickle it, or msgspec-encode it)
             ch.write(b"...", timeout_s=None)          # TimeoutError names the readers holding slots;
                                                       # on_stall=f: f(that error) decides instead
             ch.close()                                # unmaps and unlinks
    Reader:  ch = ShmBroadcast.attach(handle, reader_index=2)
             ch.read(timeout_s=5.0) -> bytes           # TimeoutError names the message it waited for
             ch.close()                                # unmaps only

    Each end is used by one thread at a time (callers that share one hold a lock).
    """

    def __init__(self, handle: ShmHandle, mapping: _Mapping, reader_index: int | None):
        self._handle = handle
        self._map = mapping
        self.reader_index = reader_index
        self._num_chunks = 0        # chunks written (writer) or consumed (reader) by this end
        self._num_messages = 0
        self._withdraw_due = False   # writer: a write gave up after publishing part of its message
        self._parts: list[bytes] = []   # chunks of a large message whose rest has not arrived yet
        self._idle_since = time.monotonic()
        self._slot_stride = _round_up(_SLOT_HEADER + handle.slot_bytes, _LINE)
        self._slots_offset = (handle.num_readers + 1) * _LINE
        self._finalizer = weakref.finalize(self, mapping.close)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def create(cls, num_readers: int, slot_bytes: int = 256 * 1024, num_slots: int = 8) -> "ShmBroadcast":
        """A new segment, with this process as its writer and owner."""
        for field, value in (("num_readers", num_readers), ("slot_bytes", slot_bytes), ("num_slots", num_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ShmBroadcast.create: {field}={value!r} must be an integer >= 1")
        name = f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
        size = (num_readers + 1) * _LINE + num_slots * _round_up(_SLOT_HEADER + slot_bytes, _LINE)
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)   # zero-filled
        return cls(ShmHandle(name, num_readers, slot_bytes, num_slots), _Mapping(shm, owner=True), None)

    @classmethod
    def attach(cls, handle: ShmHandle, reader_index: int) -> "ShmBroadcast":
        """Open an existing channel as reader `reader_index` (0 .. num_readers - 1)."""
        if not 0 <= reader_index < handle.num_readers:
            raise ValueError(f"reader_index={reader_index} is outside 0..{handle.num_readers - 1} "
                             f"for shm channel {handle.name!r}")
        return cls(handle, _Mapping(_open_untracked(handle.name), owner=False), reader_index)

    def handle(self) -> ShmHandle:
        return self._handle

    @property
    def name(self) -> str:
        return self._handle.name

    # -- writer -------------------------------------------------------------------------------

    def write(self, data: bytes, timeout_s: float | None = None,
              on_stall: Callable[[TimeoutError], None] | None = None) -> None:
        """Publish one message to every reader; waits while the slowest reader holds the slots needed.

        A wait for a slot longer than `timeout_s` raises TimeoutError (naming the readers holding it), or,
        given `on_stall`, calls it with that error: it raises to give up, or returns to wait another
        `timeout_s`. A write that gives up (by either, or an interrupt) delivered nothing; retrying is safe."""
        if self.reader_index is not None:
            raise RuntimeError(f"reader {self.reader_index} of shm channel {self.name!r} cannot write")
        h = self._handle
        if self._withdraw_due:
            self._wait_for_free_slots(1, timeout_s, on_stall)
            self._publish(b"", _WITHDRAW)
            self._withdraw_due = False
        view = memoryview(data).cast("B")
        n_chunks = max(1, -(-len(view) // h.slot_bytes))
        # A message that fits is published only once all its slots are free: all or nothing.
        self._wait_for_free_slots(min(n_chunks, h.num_slots), timeout_s, on_stall)
        try:
            for i in range(n_chunks):
                if i >= h.num_slots:
                    self._wait_for_free_slots(1, timeout_s, on_stall)
                self._publish(view[i * h.slot_bytes:(i + 1) * h.slot_bytes], _LAST if i == n_chunks - 1 else _PART)
        except BaseException:
            # Chunks already out cannot be taken back: the next write tells the readers to drop them.
            self._withdraw_due = True
            raise
        self._num_messages += 1

    def _publish(self, chunk, kind: int) -> None:
        words, buf = self._map.words, self._map.buf
        base = self._slots_offset + (self._num_chunks % self._handle.num_slots) * self._slot_stride
        buf[base + _SLOT_HEADER:base + _SLOT_HEADER + len(chunk)] = chunk
        w = base // 8
        words[w + 1] = len(chunk)
        words[w + 2] = kind
        _fence()
        words[w] = self._num_chunks + 1
        self._num_chunks += 1
        words[self._writer_word] = self._num_chunks

    def _wait_for_free_slots(self, needed: int, timeout_s: float | None,
                             on_stall: Callable[[TimeoutError], None] | None) -> None:
        words, h = self._map.words, self._handle
        limit = self._num_chunks + needed - h.num_slots   # every reader must have consumed this many
        since = time.monotonic()   # sleeps grow with the whole wait, not only the current timeout_s
        while True:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            for _ in _backoff(deadline, since):
                if min(words[r * _LINE // 8] for r in range(h.num_readers)) >= limit:
                    _fence()
                    return
            slow = [r for r in range(h.num_readers) if words[r * _LINE // 8] < limit]
            error = TimeoutError(
                f"shm channel {self.name!r}: the writer waited {time.monotonic() - since:.1f} s for readers {slow} "
                f"to free a slot for message {self._num_messages} (they consumed "
                f"{[words[r * _LINE // 8] for r in slow]} of {self._num_chunks} chunks written)")
            if on_stall is None:
                raise error
            on_stall(error)

    # -- reader -------------------------------------------------------------------------------

    def read(self, timeout_s: float | None = None) -> bytes:
        """The next message; blocks up to `timeout_s` (forever if None), then raises TimeoutError."""
        if self.reader_index is None:
            raise RuntimeError(f"the writer of shm channel {self.name!r} cannot read")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            # Chunks already read stay in self._parts, so a timeout mid-message loses nothing.
            chunk, kind = self._read_chunk(deadline, timeout_s)
            if kind == _WITHDRAW:   # the writer gave up on the message these parts began
                self._parts.clear()
                continue
            self._parts.append(chunk)
            if kind == _LAST:
                break
        parts, self._parts = self._parts, []
        self._num_messages += 1
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _read_chunk(self, deadline: float | None, timeout_s: float | None) -> tuple[bytes, int]:
        h, words = self._handle, self._map.words
        base = self._slots_offset + (self._num_chunks % h.num_slots) * self._slot_stride
        w = base // 8
        want = self._num_chunks + 1
        for _ in _backoff(deadline, self._idle_since):
            if words[w] == want:
                break
        else:
            raise TimeoutError(
                f"shm channel {self.name!r}: reader {self.reader_index} waited {timeout_s:g} s for message "
                f"{self._num_messages} from the writer (it has written {words[self._writer_word]} chunks, "
                f"this reader consumed {self._num_chunks})")
        _fence()
        nbytes, kind = words[w + 1], words[w + 2]
        data = bytes(self._map.buf[base + _SLOT_HEADER:base + _SLOT_HEADER + nbytes])
        _fence()
        self._num_chunks += 1
        words[self.reader_index * _LINE // 8] = self._num_chunks
        self._idle_since = time.monotonic()
        return data, kind

    # -- lifetime -----------------------------------------------------------------------------

    @property
    def _writer_word(self) -> int:
        return self._handle.num_readers * _LINE // 8

    def close(self) -> None:
        """Unmap; the creator also unlinks the segment. Safe to call twice."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _backoff(deadline: float | None, idle_since: float):
    """Yields until the deadline: a short spin, then sleeps that double up to a cap that grows with
    the time idle (see _SLEEP_CAPS)."""
    start = time.monotonic()
    while True:
        yield
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return
        if now - start >= _SPIN_S:
            break
    sleep_s = _FIRST_SLEEP_S
    while True:
        yield
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return
        idle = now - idle_since
        cap = next(c for after, c in _SLEEP_CAPS if idle >= after)
        sleep_s = min(sleep_s * 2, cap)
        time.sleep(sleep_s if deadline is None else max(0.0, min(sleep_s, deadline - now)))


def _open_untracked(name: str) -> shared_memory.SharedMemory:
    # Before Python 3.13 attaching registers the segment with this process's resource tracker,
    # which then unlinks it (and warns of a "leak") when this reader exits, under the creator's feet.
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    with _tracker_patch_lock:
        register = resource_tracker.register
        resource_tracker.register = lambda *args, **kwargs: None
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
