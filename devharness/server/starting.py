"""What answers on `serve`'s port while the model loads: every request, /health included, gets a 503
(`starting`, OpenAI's error shape, as /health words its other 503s) with Retry-After, at once, so a script
that polls /health neither hangs nor mistakes a refused connection for a dead server. The port itself is
bound and listening before the model loads (server/app.py), so nothing the run starts can take it."""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RETRY_AFTER_S = 1
MESSAGE = "the server is starting (loading the model); retry after the Retry-After header's seconds"
_DRAIN_BYTES = 1 << 20   # a body this size is read before answering, so closing does not reset the reply


def starting_body() -> dict:
    return {"error": {"message": MESSAGE, "type": "server_error", "code": "starting", "param": None},
            "status": "unavailable", "reason": "starting", "time": time.time(), "retry_after_s": RETRY_AFTER_S}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 5   # a client that sends nothing holds one thread this long, not the port
    server_version = "devharness"

    def _unavailable(self, head_only: bool = False):
        length = min(int(self.headers.get("Content-Length") or 0), _DRAIN_BYTES)
        if length > 0:
            self.rfile.read(length)
        body = json.dumps(starting_body()).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Retry-After", str(RETRY_AFTER_S))
        self.send_header("Connection", "close")
        self.end_headers()
        if not head_only:
            self.wfile.write(body)
        self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _unavailable

    def do_HEAD(self):
        self._unavailable(head_only=True)

    def log_message(self, format, *args):   # noqa: A002 (the base class's name): no line per poll
        pass


class StartupResponder:
    """Answers on a duplicate of the listening socket `sock` in a daemon thread until close(); `sock` stays
    open and listening, and connections not yet accepted wait in its backlog for the server that follows."""

    def __init__(self, sock: socket.socket):
        # The duplicate is non-blocking (as the listener is, shared): a connection gone before accept() is
        # then a skipped poll, never a thread blocked in accept() that close() would wait for.
        dup = sock.dup()
        dup.setblocking(False)
        self.httpd = ThreadingHTTPServer(dup.getsockname()[:2], _Handler, bind_and_activate=False)
        self.httpd.socket.close()
        self.httpd.socket = dup
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="devharness-starting", daemon=True)
        self.closed = False
        self.thread.start()

    def close(self) -> None:
        """Stop accepting (a reply already begun is still sent) and close the duplicate, not `sock`; once."""
        if self.closed:
            return
        self.closed = True
        self.httpd.shutdown()
        self.httpd.server_close()
