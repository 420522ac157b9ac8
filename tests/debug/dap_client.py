"""A small Debug Adapter Protocol client: what VS Code does when it attaches to debugpy."""
from __future__ import annotations

import json
import socket
import threading
import time


class DAPClient:
    def __init__(self, host: str, port: int, timeout_s: float = 60.0):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.timeout_s = timeout_s
        self._seq = 0
        self._buf = b""
        self._lock = threading.Lock()
        self.events: list[dict] = []
        self._responses: dict[int, dict] = {}

    # -- wire ------------------------------------------------------------------------------

    def _send(self, msg: dict) -> None:
        body = json.dumps(msg).encode()
        self.sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def _read_message(self, deadline: float) -> dict:
        while b"\r\n\r\n" not in self._buf:
            self._recv(deadline)
        header, self._buf = self._buf.split(b"\r\n\r\n", 1)
        length = int(next(h.split(b":")[1] for h in header.split(b"\r\n") if h.lower().startswith(b"content-length")))
        while len(self._buf) < length:
            self._recv(deadline)
        body, self._buf = self._buf[:length], self._buf[length:]
        return json.loads(body)

    def _recv(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("DAP: no message in time")
        self.sock.settimeout(remaining)
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("DAP: connection closed")
        self._buf += chunk

    def _pump_until(self, predicate, timeout_s: float | None = None):
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            found = predicate()
            if found is not None:
                return found
            msg = self._read_message(deadline)
            if msg["type"] == "event":
                self.events.append(msg)
            elif msg["type"] == "response":
                self._responses[msg["request_seq"]] = msg
            elif msg["type"] == "request":       # reverse requests (e.g. runInTerminal): decline
                self._send({"type": "response", "seq": self._next_seq(), "request_seq": msg["seq"],
                            "command": msg["command"], "success": False})

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # -- requests --------------------------------------------------------------------------

    def send_request(self, command: str, arguments: dict | None = None) -> int:
        seq = self._next_seq()
        self._send({"type": "request", "seq": seq, "command": command, "arguments": arguments or {}})
        return seq

    def wait_response(self, seq: int, timeout_s: float | None = None) -> dict:
        resp = self._pump_until(lambda: self._responses.pop(seq, None), timeout_s)
        if not resp.get("success", False):
            raise RuntimeError(f"DAP {resp.get('command')} failed: {resp.get('message')} {resp.get('body')}")
        return resp.get("body", {})

    def request(self, command: str, arguments: dict | None = None, timeout_s: float | None = None) -> dict:
        return self.wait_response(self.send_request(command, arguments), timeout_s)

    def wait_event(self, name: str, timeout_s: float | None = None, predicate=None) -> dict:
        def find():
            for i, e in enumerate(self.events):
                if e["event"] == name and (predicate is None or predicate(e)):
                    return self.events.pop(i)
            return None
        return self._pump_until(find, timeout_s)

    # -- what VS Code does ------------------------------------------------------------------

    def attach(self, breakpoints: dict[str, list[int]] | None = None, exception_filters=("uncaught",)) -> None:
        """initialize, attach, setBreakpoints, setExceptionBreakpoints, configurationDone."""
        self.request("initialize", {"clientID": "devharness-tests", "adapterID": "debugpy", "pathFormat": "path",
                                    "linesStartAt1": True, "columnsStartAt1": True})
        attach_seq = self.send_request("attach", {"justMyCode": False, "subProcess": False})
        self.wait_event("initialized")
        for path, lines in (breakpoints or {}).items():
            self.set_breakpoints(path, lines)
        self.request("setExceptionBreakpoints", {"filters": list(exception_filters)})
        self.request("configurationDone")
        self.wait_response(attach_seq)

    def set_breakpoints(self, path: str, lines: list[int]) -> list[dict]:
        body = self.request("setBreakpoints", {"source": {"path": path},
                                               "breakpoints": [{"line": n} for n in lines]})
        return body["breakpoints"]

    def wait_stopped(self, timeout_s: float | None = None) -> dict:
        return self.wait_event("stopped", timeout_s)["body"]

    def stack_trace(self, thread_id: int) -> list[dict]:
        return self.request("stackTrace", {"threadId": thread_id})["stackFrames"]

    def evaluate(self, expression: str, frame_id: int) -> str:
        return self.request("evaluate", {"expression": expression, "frameId": frame_id,
                                         "context": "repl"})["result"]

    def continue_(self, thread_id: int) -> None:
        self.request("continue", {"threadId": thread_id})

    def exception_info(self, thread_id: int) -> dict:
        return self.request("exceptionInfo", {"threadId": thread_id})

    def disconnect(self) -> None:
        try:
            self.request("disconnect", {"terminateDebuggee": False}, timeout_s=5)
        except Exception:
            pass
        finally:
            self.sock.close()


def release(port: int, join=None, host: str = "127.0.0.1", timeout_s: float = 60.0) -> dict:
    """Attach to a worker stopped at a breakpoint, let it continue and wait for `join` (a thread);
    returns the stopped event's body."""
    client = DAPClient(host, port)
    try:
        client.attach()
        stopped = client.wait_stopped()
        client.continue_(stopped["threadId"])
        if join is not None:
            join.join(timeout_s)
        return stopped
    finally:
        client.disconnect()
