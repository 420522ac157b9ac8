"""A minimal Debug Adapter Protocol client: what VS Code sends when it attaches to a worker's debugpy port.

Not an example itself (the leading underscore keeps it out of the set CI runs): the examples that stop a
rank import it to look at that rank as an IDE would, with no IDE on the machine.
"""
from __future__ import annotations

import json
import socket


class DAPClient:
    """One connection to one rank's debugpy listener (127.0.0.1:debug-port-base + rank)."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout_s: float = 60.0):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.buf, self.seq = b"", 0
        self.events: list[dict] = []
        self.responses: dict[int, dict] = {}

    def send(self, command: str, **arguments) -> int:
        self.seq += 1
        body = json.dumps({"type": "request", "seq": self.seq, "command": command, "arguments": arguments}).encode()
        self.sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return self.seq

    def _read_one(self) -> None:
        while b"\r\n\r\n" not in self.buf:
            self._recv()
        header, self.buf = self.buf.split(b"\r\n\r\n", 1)
        length = int(next(h.split(b":")[1] for h in header.split(b"\r\n") if h.lower().startswith(b"content-length")))
        while len(self.buf) < length:
            self._recv()
        msg, self.buf = json.loads(self.buf[:length]), self.buf[length:]
        if msg["type"] == "event":
            self.events.append(msg)
        elif msg["type"] == "response":
            self.responses[msg["request_seq"]] = msg

    def _recv(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("debugpy closed the connection")
        self.buf += chunk

    def response(self, seq: int) -> dict:
        while seq not in self.responses:
            self._read_one()
        msg = self.responses.pop(seq)
        if not msg.get("success"):
            raise RuntimeError(f"DAP {msg.get('command')} failed: {msg.get('message')}")
        return msg.get("body", {})

    def request(self, command: str, **arguments) -> dict:
        return self.response(self.send(command, **arguments))

    def event(self, name: str) -> dict:
        while not any(e["event"] == name for e in self.events):
            self._read_one()
        found = next(e for e in self.events if e["event"] == name)
        self.events.remove(found)
        return found.get("body", {})

    def attach(self) -> None:
        """initialize, attach, configurationDone: the handshake of VS Code's "attach" configuration."""
        self.request("initialize", clientID="devharness-example", adapterID="debugpy", pathFormat="path",
                     linesStartAt1=True, columnsStartAt1=True)
        attach = self.send("attach", justMyCode=False, subProcess=False)
        self.event("initialized")
        self.request("configurationDone")
        self.response(attach)

    def wait_stopped(self) -> tuple[int, list[dict]]:
        """The stopped thread and its stack, innermost frame first."""
        thread = self.event("stopped")["threadId"]
        return thread, self.request("stackTrace", threadId=thread)["stackFrames"]

    def evaluate(self, expression: str, frame_id: int) -> str:
        return self.request("evaluate", expression=expression, frameId=frame_id, context="repl")["result"]

    def continue_(self, thread: int) -> None:
        self.request("continue", threadId=thread)

    def close(self) -> None:
        try:
            self.request("disconnect", terminateDebuggee=False)
        except (OSError, RuntimeError):
            pass
        self.sock.close()
