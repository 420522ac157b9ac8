"""For `bench debug-overhead`: DAP clients attached to workers as an IDE attaches, and free ports."""
from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time

from devharness.protocol.messages import GetState


class AttachedClient:
    """initialize, attach, setExceptionBreakpoints (an IDE's default: uncaught), configurationDone; then a
    thread reads and drops whatever debugpy sends, so its writes never block on a full socket."""

    def __init__(self, host: str, port: int, timeout_s: float = 60.0):
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._buf, self._seq = b"", 0
        self._request("initialize", {"clientID": "devharness-bench", "adapterID": "debugpy", "pathFormat": "path",
                                     "linesStartAt1": True, "columnsStartAt1": True})
        attach = self._send("attach", {"justMyCode": False, "subProcess": False})
        self._read_until(lambda m: m.get("event") == "initialized")
        self._request("setExceptionBreakpoints", {"filters": ["uncaught"]})
        self._request("configurationDone")
        self._read_until(lambda m: m.get("request_seq") == attach)
        self._sock.settimeout(None)
        self._drain = threading.Thread(target=self._drop_all, name=f"dap-drain-{port}", daemon=True)
        self._drain.start()

    def _send(self, command: str, arguments: dict | None = None) -> int:
        self._seq += 1
        body = json.dumps({"type": "request", "seq": self._seq, "command": command,
                           "arguments": arguments or {}}).encode()
        self._sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return self._seq

    def _request(self, command: str, arguments: dict | None = None) -> None:
        seq = self._send(command, arguments)
        msg = self._read_until(lambda m: m.get("request_seq") == seq)
        if not msg.get("success"):
            raise RuntimeError(f"DAP {command} failed: {msg.get('message')}")

    def _read_until(self, predicate) -> dict:
        while True:
            while b"\r\n\r\n" not in self._buf:
                self._recv()
            body_at = self._buf.index(b"\r\n\r\n") + 4
            length = int(next(h.split(b":")[1] for h in self._buf[:body_at].split(b"\r\n")
                              if h.lower().startswith(b"content-length")))
            while len(self._buf) < body_at + length:
                self._recv()
            msg = json.loads(self._buf[body_at:body_at + length])
            self._buf = self._buf[body_at + length:]
            if predicate(msg):
                return msg

    def _recv(self) -> None:
        chunk = self._sock.recv(65536)
        if not chunk:
            raise ConnectionError("DAP: debugpy closed the connection")
        self._buf += chunk

    def _drop_all(self) -> None:
        with contextlib.suppress(OSError):
            while self._sock.recv(65536):
                pass

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._send("disconnect", {"terminateDebuggee": False})
            self._sock.shutdown(socket.SHUT_RDWR)   # wakes the drain thread's recv
        self._sock.close()
        self._drain.join(5.0)


def wait_clients_seen(llm, world: int, timeout_s: float = 30.0) -> None:
    """Until every worker's published state says a client is attached (debugpy's own view of it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = llm.engine.workers.control(GetState())
        if all(s.debugpy is not None and s.debugpy.client_connected for s in states):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"DAP clients attached, but not every one of the {world} workers saw its client")
        time.sleep(0.2)


def free_port_bases(count: int, width: int) -> list[int]:
    """`count` port bases, each with `width` free ports above it, none overlapping, below the kernel's ephemeral
    range: a port from that range, free when checked, can be handed to an outgoing connection (gloo's, Ray's)
    before the workers listen on it, which then fails with "Address already in use"."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    bases: list[int] = []
    while len(bases) < count:
        base = random.SystemRandom().randrange(10000, max(10001, low - width))   # whatever a test seeded
        if all(abs(base - b) >= width for b in bases) and all(_port_free(base + i) for i in range(width)):
            bases.append(base)
    return bases


def _port_free(port: int) -> bool:
    with socket.socket() as s, contextlib.suppress(OSError):
        s.bind(("127.0.0.1", port))
        return True
    return False
