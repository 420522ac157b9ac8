"""Each worker's output, prints and log records (INFO and up) alike, also goes to a file of its own
beside its state file, which the driver reads without the worker's help (the TUI's Logs pane, GET
/debug/workers/{rank}/logs): a worker paused in a debugger or hung in a collective still shows what it
last said. The file is kept under MAX_BYTES by starting over, the previous one kept as `.1`.

Only output written through Python's sys.stdout / sys.stderr is seen; native libraries writing to the
file descriptors directly still reach the console (or Ray's log files) alone.
"""
from __future__ import annotations

import io
import logging
import os
import sys
import threading
from pathlib import Path

from devharness.debug.redact import redact
from devharness.debug.state import STATE_DIR

MAX_BYTES = 1 << 20


def log_path(run_id: str, rank: int) -> Path:
    return STATE_DIR / f"devharness-{run_id}-rank{rank}.log"


class _Tee(io.TextIOBase):
    """Writes to the stream it replaces and to the log file; everything else is the stream's."""

    def __init__(self, stream, log: "_LogFile"):
        self._stream, self._log = stream, log

    def write(self, s: str) -> int:
        n = self._stream.write(s)
        self._log.write(s)
        return len(s) if n is None else n

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):   # fileno, encoding, isatty, buffer ...
        return getattr(self._stream, name)


class _LogFile:
    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()   # stdout and stderr, from any thread
        self._f = self._open()

    def _open(self):
        # The user's alone from the first byte (a file left from before keeps its mode: chmod too).
        f = open(self.path, "w", encoding="utf-8", errors="replace", opener=lambda p, fl: os.open(p, fl, 0o600))
        os.chmod(self.path, 0o600)
        return f

    def write(self, s: str) -> None:
        with self._lock:
            if self._f.closed:
                return
            if self._f.tell() > MAX_BYTES:
                self._f.close()
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                self._f = self._open()
            self._f.write(redact(s))   # a secret printed reaches the console, not the file
            if "\n" in s:
                self._f.flush()

    def flush(self) -> None:   # each line is flushed as written
        pass

    def close(self) -> None:
        with self._lock:
            self._f.close()


_log: _LogFile | None = None


def capture(run_id: str, rank: int) -> Path:
    """From now on what this process prints also goes to rank `rank`'s log file, and so do devharness's
    log records from INFO up, whatever the console shows (once per process: a worker process runs one
    rank)."""
    global _log
    if _log is not None:
        return _log.path
    _log = _LogFile(log_path(run_id, rank))
    sys.stdout, sys.stderr = _Tee(sys.stdout, _log), _Tee(sys.stderr, _log)
    # Handlers made before keep writing to the console streams themselves (not through the tees, which
    # would write their lines twice), at the level the console had.
    log = logging.getLogger("devharness")
    console_level = log.getEffectiveLevel()
    for h in logging.getLogger().handlers + log.handlers:
        if h.level == logging.NOTSET:
            h.setLevel(console_level)
    to_file = logging.StreamHandler(_log)
    to_file.setLevel(logging.INFO)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(to_file)
    log.setLevel(min(console_level, logging.INFO))
    return _log.path


def tail(path: Path, max_lines: int = 200) -> list[str]:
    """The last `max_lines` lines of a worker's log (with its previous file, if this one is short)."""
    lines: list[str] = []
    for p in (path, path.with_name(path.name + ".1")):
        try:
            with open(p, "rb") as f:
                start = max(0, os.fstat(f.fileno()).st_size - 256 * max_lines)
                f.seek(start)
                chunk = f.read().decode("utf-8", errors="replace").splitlines()[1 if start else 0:]
        except FileNotFoundError:
            continue
        lines = chunk[-(max_lines - len(lines)):] + lines
        if len(lines) >= max_lines:
            break
    return lines[-max_lines:]
