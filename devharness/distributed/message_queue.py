"""The driver's call queue: each call (a step, a control call, exit) is written once and read by
every worker. Workers on the driver's node read a shared-memory ring (shm_ring.py); workers on
other nodes, which share no memory with it, a TCP connection (tcp_channel.py), on which they may
also answer. One API for both, whichever mix of nodes a run has.
"""
from __future__ import annotations

import secrets
from collections.abc import Callable

import msgspec

from devharness.distributed.shm_ring import ShmBroadcast, ShmHandle
from devharness.distributed.tcp_channel import TcpDriverChannel, TcpWorkerChannel


# The step ring: 8 slots of 256 KiB. A step message larger than the ring streams through it at its slowest
# reader's pace (shm_ring.py). Read when a queue is made, so a test may make it smaller.
RING_SLOT_BYTES = 256 * 1024
RING_SLOTS = 8


class QueueHandle(msgspec.Struct, frozen=True):
    """How one worker reaches the queue; travels to it (through a spawn or a Ray call)."""

    shm: ShmHandle | None = None
    reader_index: int | None = None
    tcp_address: tuple[str, int] | None = None
    tcp_token: bytes | None = None

    @property
    def kind(self) -> str:
        return "shm" if self.shm is not None else "tcp"


class MessageQueue:
    """The driver's end. `local`: ranks on the driver's node (the ring); `remote`: the others (TCP,
    listening on `host`), which must connect (accept()) before the first write."""

    def __init__(self, local: list[int], remote: list[int] = (), host: str = "127.0.0.1",
                 send_timeout_s: float | None = None):
        self.ring = ShmBroadcast.create(len(local), RING_SLOT_BYTES, RING_SLOTS) if local else None
        self.tcp = None
        self._handles = {r: QueueHandle(shm=self.ring.handle(), reader_index=i) for i, r in enumerate(local)}
        if remote:
            token = secrets.token_bytes(16)
            self.tcp = TcpDriverChannel.listen(host, token, send_timeout_s)
            self._handles.update({r: QueueHandle(tcp_address=self.tcp.address, tcp_token=token) for r in remote})
        self.remote = set(remote)

    def handle(self, rank: int) -> QueueHandle:
        return self._handles[rank]

    def paths(self) -> dict[int, str]:
        """How each rank reads calls: "shm" or "tcp"."""
        return {r: h.kind for r, h in sorted(self._handles.items())}

    def accept(self, timeout_s: float) -> None:
        """Wait for the remote workers' connections; TimeoutError names those still missing."""
        if self.tcp is not None:
            self.tcp.accept(self.remote, timeout_s)

    def write(self, data: bytes, timeout_s: float | None = None,
              on_stall: Callable[[TimeoutError], None] | None = None) -> None:
        """One call to every worker. A local reader that holds the ring's slots longer than `timeout_s`
        raises TimeoutError, or, given `on_stall`, calls it (ShmBroadcast.write: it raises to give up);
        a write that gives up delivered nothing to the local readers. An OSError: a remote worker's
        connection is gone."""
        if self.ring is not None:
            self.ring.write(data, timeout_s=timeout_s, on_stall=on_stall)
        if self.tcp is not None:
            self.tcp.broadcast(data)

    def read_from(self, rank: int, timeout_s: float) -> bytes | None:
        """A remote worker's answer, or None within `timeout_s`; ConnectionError when it hung up."""
        return self.tcp.read_from(rank, timeout_s)

    def close(self) -> None:
        for ch in (self.ring, self.tcp):
            if ch is not None:
                ch.close()


class WorkerEnd:
    """A worker's end: calls in; on TCP, answers out on the same connection."""

    def __init__(self, handle: QueueHandle, rank: int):
        if handle.shm is not None:
            self._ring, self._tcp = ShmBroadcast.attach(handle.shm, handle.reader_index), None
        else:
            self._ring, self._tcp = None, TcpWorkerChannel.connect(handle.tcp_address, rank, handle.tcp_token)

    @property
    def can_answer(self) -> bool:
        return self._tcp is not None

    def read(self, timeout_s: float | None) -> bytes:
        """The next call; TimeoutError if none comes within `timeout_s` (None: wait as long as it takes)."""
        if self._ring is not None:
            return self._ring.read(timeout_s)
        data = self._tcp.read(timeout_s)
        if data is None:
            raise TimeoutError(f"no call from the driver within {timeout_s} s")
        return data

    def write(self, data: bytes) -> None:
        self._tcp.write(data)

    def close(self) -> None:
        (self._ring or self._tcp).close()
