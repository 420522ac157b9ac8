"""The control plane's TCP fallback: step messages to workers on nodes that share no memory with
the driver, and the output rank's results back.

Frames are protocol's length prefix (frames.LENGTH: a 4-byte big-endian length) and msgpack bytes; nothing read from
a socket is unpickled.
A worker proves it was started by this executor with a random token that travels through Ray.
"""
from __future__ import annotations

import hmac
import select
import socket
import time

import msgspec

from devharness.protocol.frames import LENGTH, Hello, encode, hello_decoder

MAX_FRAME_BYTES = 1 << 30
# Before a peer has shown the token it may send only this much: a stranger cannot make us buffer a GiB.
_MAX_HELLO_BYTES = 1024
_HELLO_TIMEOUT_S = 5.0


def _readable(sock: socket.socket, timeout_s: float | None) -> bool:
    """Wait until `sock` can be read (or accept); poll, since select() fails on descriptors >= 1024."""
    if not hasattr(select, "poll"):
        return bool(select.select([sock], [], [], None if timeout_s is None else max(0.0, timeout_s))[0])
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else max(0, int(timeout_s * 1000))))


class _FramedSocket:
    """Length-prefixed frames over one socket; a read that times out keeps any partial frame."""

    def __init__(self, sock: socket.socket, send_timeout_s: float | None = None,
                 max_frame_bytes: int = MAX_FRAME_BYTES):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Bounds sendall to a peer that stopped reading; reads wait in select() with their own timeout.
        sock.settimeout(send_timeout_s)
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()

    def send(self, data: bytes) -> None:
        header = LENGTH.pack(len(data))
        if len(data) < 65536:
            # One write: with TCP_NODELAY, header and body sent apart cost two packets per step.
            self.sock.sendall(header + data)
        else:
            self.sock.sendall(header)
            self.sock.sendall(data)

    def _frame(self) -> bytes | None:
        if len(self._buf) < LENGTH.size:
            return None
        (n,) = LENGTH.unpack_from(self._buf)
        if n > self.max_frame_bytes:
            raise ConnectionError(f"peer sent a {n}-byte frame (limit {self.max_frame_bytes}); closing")
        if len(self._buf) < LENGTH.size + n:
            return None
        frame = bytes(self._buf[LENGTH.size:LENGTH.size + n])
        del self._buf[:LENGTH.size + n]
        return frame

    def recv(self, timeout_s: float | None) -> bytes | None:
        """The next frame, or None if none completes within timeout_s (None waits forever)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            frame = self._frame()
            if frame is not None:
                return frame
            if not _readable(self.sock, None if deadline is None else deadline - time.monotonic()):
                return None
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("peer closed the connection")
            self._buf += chunk

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class TcpDriverChannel:
    """Driver side: listens on the driver node's IP; each remote worker connects once."""

    def __init__(self, listener: socket.socket, token: bytes, send_timeout_s: float):
        self._listener = listener
        self._token = token
        self._send_timeout_s = send_timeout_s
        self.peers: dict[int, _FramedSocket] = {}

    @classmethod
    def listen(cls, host: str, token: bytes, send_timeout_s: float) -> "TcpDriverChannel":
        """Bound to `host` (the driver node's IP), not to every interface."""
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((host, 0))
        listener.listen()
        return cls(listener, token, send_timeout_s)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return host, port

    def accept(self, ranks: set[int], timeout_s: float) -> None:
        """Wait until every rank in `ranks` has connected with the right token."""
        deadline = time.monotonic() + timeout_s
        while not ranks <= self.peers.keys():
            if not _readable(self._listener, deadline - time.monotonic()):
                missing = sorted(ranks - self.peers.keys())
                raise TimeoutError(f"rank(s) {missing} have not connected to the driver's TCP control channel "
                                   f"at {self.address[0]}:{self.address[1]}")
            sock, _ = self._listener.accept()
            peer = _FramedSocket(sock, _HELLO_TIMEOUT_S, max_frame_bytes=_MAX_HELLO_BYTES)
            try:
                raw = peer.recv(_HELLO_TIMEOUT_S)
                hello = hello_decoder.decode(raw) if raw is not None else None
            except (ConnectionError, OSError, msgspec.DecodeError):
                hello = None
            if (hello is None or hello.rank not in ranks or hello.rank in self.peers
                    or not hmac.compare_digest(hello.token, self._token)):
                peer.close()  # not one of ours: a stray or hostile connection
                continue
            peer.sock.settimeout(self._send_timeout_s)
            peer.max_frame_bytes = MAX_FRAME_BYTES
            self.peers[hello.rank] = peer

    def broadcast(self, data: bytes) -> None:
        for peer in self.peers.values():
            peer.send(data)

    def read_from(self, rank: int, timeout_s: float) -> bytes | None:
        return self.peers[rank].recv(timeout_s)

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        self.peers.clear()
        try:
            self._listener.close()
        except OSError:
            pass


class TcpWorkerChannel:
    """Worker side: step messages in, (output rank only) results out."""

    def __init__(self, peer: _FramedSocket):
        self._peer = peer

    @classmethod
    def connect(cls, address: tuple[str, int], rank: int, token: bytes) -> "TcpWorkerChannel":
        sock = socket.create_connection(tuple(address), timeout=_HELLO_TIMEOUT_S)
        peer = _FramedSocket(sock)   # the result write waits as long as the driver needs
        peer.send(encode(Hello(rank, token)))
        return cls(peer)

    def read(self, timeout_s: float) -> bytes | None:
        return self._peer.recv(timeout_s)

    def write(self, data: bytes) -> None:
        self._peer.send(data)

    def close(self) -> None:
        self._peer.close()
