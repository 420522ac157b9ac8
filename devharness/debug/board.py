"""The shared-memory files a worker publishes its state in: one writer (the worker), any reader.

A worker's state file holds:

- a record (msgpack WorkerState: who it is, its debugger, where it is paused), written whole into one of
  two slots; the reader takes the slot the sequence number points at and retries if the writer moved on
  meanwhile (a seqlock over two slots). Written at start, at pauses and on debugger changes.
- the step block: step, batch, KV use, last step time, and the wall time the phase word counts from;
  written at each step's start and end, under a version word of its own (odd while being written).
- the phase word, written at every phase change (a few times a layer: each collective is entered and
  left): one aligned 8-byte store of the time since the step began in microseconds, a site (which phase,
  detail and peers, looked up in the site table) and whether the worker has left that site. The code
  right after a collective's wait runs on cold caches; the less it does the better, and one store is
  the least there is.
- the site table, append-only: a site is written whole before the count that makes it visible, and
  before any word names it.

The history file is a ring of fixed-size step records (time in each phase), the newest `num_slots - 1`
readable.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from pathlib import Path
from typing import NamedTuple

_SEQ, _LENS = 0, 1                       # words: record sequence number; lengths of slot 0 and 1 (u32 each)
_WORD_AT = 16                            # u64 phase word
_BLOCK_VERSION_AT = 24                   # u64, odd while the step block is being written
_BLOCK = struct.Struct("<QQQQdd")        # step, num_reqs, num_tokens, kv_blocks_used, last_step_ms, base
_BLOCK_AT = 32
_SITE_COUNT_AT = _BLOCK_AT + _BLOCK.size
_SITE = struct.Struct("<BBBB4x8h48s")    # phase, phase after leaving, n_wait, n_detail, waits, detail
_SITES_AT = _SITE_COUNT_AT + 8
MAX_SITES = 1024
SLOTS_AT = _SITES_AT + MAX_SITES * _SITE.size
_SITE_DETAIL_BYTES, _SITE_MAX_WAIT = 48, 8
_TIME_BITS, _SITE_BITS = 42, 14          # 2**42 us is 50 days: a step would have to run that long
SITE_SHIFT, TIME_SHIFT, LEFT = 8, 8 + _SITE_BITS, 1
WORD_INDEX = _WORD_AT // 8
assert MAX_SITES <= 2 ** _SITE_BITS and all(x % 8 == 0 for x in (_BLOCK_AT, _SITE_COUNT_AT, _SITES_AT, SLOTS_AT))


def pack_word(since_base_s: float, site: int, left: bool) -> int:
    return (int(since_base_s * 1e6) << TIME_SHIFT) | (site << SITE_SHIFT) | left


def unpack_word(word: int) -> tuple[float, int, bool]:
    """(seconds since the base, site, left)."""
    return (word >> TIME_SHIFT) / 1e6, (word >> SITE_SHIFT) & (2 ** _SITE_BITS - 1), bool(word & LEFT)


class Site(NamedTuple):
    """Where in a step a worker can be: a phase with its detail and peers (collective, "layer 3 mlp
    all_reduce", (1,)), and the phase it goes back to when it leaves (forward)."""

    phase: int
    ret: int
    detail: str
    waiting_for: tuple[int, ...] | None


class StepBlock(NamedTuple):
    """What the step block says: the step running (or last run), its batch, KV use and time."""

    step: int
    num_reqs: int
    num_tokens: int
    kv_blocks_used: int
    last_step_ms: float | None
    base: float      # the wall time the phase word's time counts from


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
    """One worker's state file (see the module's docstring)."""

    def __init__(self, path: Path, create: bool, slot_bytes: int = 4096):
        self.path = Path(path)
        self._mm = _map(self.path, SLOTS_AT + 2 * slot_bytes if create else None, create)
        self._slot = (len(self._mm) - SLOTS_AT) // 2
        self.words = memoryview(self._mm).cast("Q")   # aligned 8-byte stores and loads; words[WORD_INDEX]
        self._seq = 0
        self._lens = [0, 0]
        self._block_version = 0
        self._sites: list[Site] = []                   # the reader's copy of the table

    # -- writer ----------------------------------------------------------------------------

    def write_record(self, data: bytes) -> None:
        if len(data) > self._slot:
            data = data[:0]   # an oversized record is dropped rather than torn; callers keep records small
        slot = (self._seq + 1) % 2
        start = SLOTS_AT + slot * self._slot
        self._mm[start:start + len(data)] = data
        self._lens[slot] = len(data)
        self._seq += 1
        # The lengths, then the sequence number: each one aligned 8-byte store, in that order.
        self.words[_LENS] = self._lens[0] | self._lens[1] << 32
        self.words[_SEQ] = self._seq

    def write_step(self, step: int, num_reqs: int, num_tokens: int, kv_blocks_used: int,
                   last_step_ms: float | None, base: float, word: int) -> None:
        """The step block (StepBlock's fields) and, inside the same version, the phase word, which counts
        from the block's base."""
        words, version = self.words, self._block_version
        words[_BLOCK_VERSION_AT // 8] = version + 1
        _BLOCK.pack_into(self._mm, _BLOCK_AT, step, num_reqs, num_tokens, kv_blocks_used,
                         math.nan if last_step_ms is None else last_step_ms, base)
        words[WORD_INDEX] = word
        words[_BLOCK_VERSION_AT // 8] = self._block_version = version + 2

    def add_site(self, index: int, site: Site) -> None:
        waits = (site.waiting_for or ())[:_SITE_MAX_WAIT]
        detail = site.detail.encode()[:_SITE_DETAIL_BYTES]
        _SITE.pack_into(self._mm, _SITES_AT + index * _SITE.size, site.phase, site.ret, len(waits), len(detail),
                        *waits, *([0] * (_SITE_MAX_WAIT - len(waits))), detail)
        self.words[_SITE_COUNT_AT // 8] = index + 1

    # -- reader ----------------------------------------------------------------------------

    def read(self) -> tuple[bytes, StepBlock, int, Site] | None:
        """(latest record, step block, phase word, the word's site), or None before the first record."""
        mm, words = self._mm, self.words
        for _ in range(1000):
            seq, lens = words[_SEQ], words[_LENS]
            if seq == 0:
                return None
            slot = seq % 2
            data = mm[SLOTS_AT + slot * self._slot:SLOTS_AT + slot * self._slot + (lens >> 32 * slot) % 2 ** 32]
            version = words[_BLOCK_VERSION_AT // 8]
            block = _BLOCK.unpack_from(mm, _BLOCK_AT)
            word = words[WORD_INDEX]
            # After publishing seq the writer fills the other slot, then ours again after seq + 1: the
            # copy is whole only if nothing was published meanwhile. Likewise for the step block.
            if version % 2 or words[_BLOCK_VERSION_AT // 8] != version or words[_SEQ] != seq:
                continue
            site = (word >> SITE_SHIFT) & (2 ** _SITE_BITS - 1)
            if site >= len(self._sites):
                self._read_sites(words[_SITE_COUNT_AT // 8])
            if site >= len(self._sites):
                continue
            step, reqs, tokens, kv, last_ms, base = block
            return data, StepBlock(step, reqs, tokens, kv, None if math.isnan(last_ms) else last_ms, base), \
                word, self._sites[site]
        return None

    def _read_sites(self, count: int) -> None:
        for i in range(len(self._sites), min(count, MAX_SITES)):
            phase, ret, n_wait, n_detail, *rest = _SITE.unpack_from(self._mm, _SITES_AT + i * _SITE.size)
            waits, detail = rest[:_SITE_MAX_WAIT], rest[_SITE_MAX_WAIT]
            self._sites.append(Site(phase, ret, detail[:n_detail].decode(errors="replace"),
                                    tuple(waits[:n_wait]) or None))

    def close(self, unlink: bool = False) -> None:
        self.words.release()
        _close(self._mm, self.path if unlink else None)


class StepRing:
    """The last `num_slots - 1` step records: (step, num_tokens, start unix time, total ms, seconds in each phase).
    Each step writes only its own slot, then the count that makes it visible."""

    _COUNT = struct.Struct("<Q")

    def __init__(self, path: Path, num_phases: int, num_slots: int = 0, create: bool = False):
        self.path = Path(path)
        self._record = struct.Struct(f"<QQdd{num_phases}d")
        self._mm = _map(self.path, self._COUNT.size + num_slots * self._record.size if create else None, create)
        self.num_slots = (len(self._mm) - self._COUNT.size) // self._record.size
        self._count = 0

    def append(self, step: int, num_tokens: int, started_at: float, total_ms: float, phase_s: list[float]) -> None:
        self._record.pack_into(self._mm, self._COUNT.size + (self._count % self.num_slots) * self._record.size,
                               step, num_tokens, started_at, total_ms, *phase_s)
        self._count += 1
        self._COUNT.pack_into(self._mm, 0, self._count)

    def read(self) -> list[tuple]:
        """Oldest first. The slot the writer fills next may be mid-write, so it is never returned."""
        for _ in range(100):
            count = self._COUNT.unpack_from(self._mm, 0)[0]
            out = [self._record.unpack_from(self._mm, self._COUNT.size + (i % self.num_slots) * self._record.size)
                   for i in range(max(0, count - (self.num_slots - 1)), count)]
            # A new record may have begun overwriting the oldest slot read: then read again.
            if self._COUNT.unpack_from(self._mm, 0)[0] == count:
                return out
        return []

    def close(self, unlink: bool = False) -> None:
        _close(self._mm, self.path if unlink else None)
