"""Bundles: everything needed to take a failure home, in one directory.

Written on a worker exception, on a hang the detector reports, on a stall the scheduler's stall detector reports
(engine/request_story.py: each stall kind and request once), or on demand (`POST /debug/bundle`, the
TUI's `d`, `devharness bundle --url URL`). Everything is read from the driver's side: the flight
recorder's steps, and each worker's published state, step history, log file and py-spy stacks, so a
bundle can be written while a rank is hung or paused.

    bundle.json          why (reason, error, hang, stalls), when, run id, the steps it holds and the failing one,
                         the engine's stats, the config, the kernels (backend, dtype, device, per op), the weights'
                         format (as shipped in quantized blocks, dequantized or float; their memory) and versions
    manifest.json, steps.msgpack, held.msgpack
                         the flight recorder's last steps as a partial recording (protocol/recording.py):
                         `devharness replay BUNDLE` runs them again up to the failing step
    hang.txt             who waits for whom now (diagnostics/hang.py), and the detector's event
    requests.json        each request's story (running, waiting, the last finished) and the stalls seen
    driver.json          the driver's last steps (scheduled, sent, done, applied) and the stories: the trace's driver
    rank<R>/state.json   WorkerState    rank<R>/history.json  [StepRecord]
    rank<R>/log.txt      its last log lines    rank<R>/stacks.txt  every thread's Python stack
    rank<R>/collectives.json   its collective ledger (Ledger: debug/ledger.py)
    numerics.json        on a non-finite value (--numerics-check): per rank, its alarms and the absmax of each layer's
                         sites and of the logits in its last steps
    fr/rank_<R>          the ledgers in Flight Recorder's dump format (diagnostics/torch_fr.py):
                         `python -m torch.distributed.flight_recorder.fr_trace BUNDLE/fr` reads them
"""
from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from devharness.debug.redact import redact
from devharness.protocol.json_codecs import read_ledger
from devharness.protocol.recording import write_recording

logger = logging.getLogger(__name__)
BUNDLE_JSON = "bundle.json"
LOG_LINES = 2000


def default_dir() -> Path:
    return Path(tempfile.gettempdir()) / "devharness-bundles"


def _new_dir(root: Path, run_id: str, step: int, reason: str) -> Path:
    """A new directory that only its user may enter (0700 from the start: what is written in it before
    `_seal` is never readable by others), under `root` (made 0700 too if it is new)."""
    slug = re.sub(r"[^a-z0-9]+", "-", reason.lower()).strip("-")[:24] or "bundle"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    for n in range(1000):
        d = root / (f"{run_id}-step{step}-{slug}-{stamp}" + ("" if n == 0 else f"-{n}"))
        try:
            d.mkdir(mode=0o700)
            os.chmod(d, 0o700)   # whatever the umask
            return d
        except FileExistsError:
            continue
    raise RuntimeError(f"{root}: could not make a new bundle directory")


def _seal(d: Path) -> None:
    """Every folder of the bundle 0700 and every file 0600: it holds the run's logs and stacks."""
    for p in [d, *d.rglob("*")]:
        os.chmod(p, 0o700 if p.is_dir() else 0o600)


def _write_text(path: Path, text: str) -> None:
    path.write_text(redact(text))   # a secret a log line or a stack shows is masked (debug/redact.py)


def _write_json(path: Path, obj) -> None:
    _write_text(path, msgspec.json.format(msgspec.json.encode(obj), indent=1).decode() + "\n")


def _worker_files(monitor, rank: int, d: Path) -> None:
    """One rank's state, history, log and stacks; what cannot be read says why, in its file."""
    d.mkdir()
    for name, read in (("state.json", lambda: monitor.worker_state(rank)),
                       ("history.json", lambda: monitor.history(rank)),
                       ("collectives.json", lambda: monitor.collectives(rank))):
        try:
            _write_json(d / name, read())
        except Exception as e:
            _write_json(d / name, {"error": f"{type(e).__name__}: {e}"})
    for name, read in (("log.txt", lambda: "\n".join(monitor.logs(rank, LOG_LINES)) + "\n"),
                       ("stacks.txt", lambda: monitor.stack(rank)["stacks"])):
        try:
            _write_text(d / name, read())
        except Exception as e:
            _write_text(d / name, f"not available: {type(e).__name__}: {e}\n")


def _driver_file(engine, d: Path) -> None:
    """driver.json: the driver's last steps and the requests' stories (devharness trace's driver process)."""
    try:
        obj = engine.driver_timeline()
    except Exception as e:   # a step changed the scheduler as it was read
        obj = {"error": f"{type(e).__name__}: {e}"}
    _write_json(d / "driver.json", obj)


def read_requests(engine) -> dict:
    """What requests.json holds: the scheduler's stories, events included, and its stalls (engine/request_story.py)."""
    snap = engine.requests_snapshot()
    stories = [engine.request_story(r.request_id) or r for r in snap.requests]
    return {"step": snap.step, "stalls": snap.stalls, "requests": stories}


def _requests_file(engine, d: Path, requests: dict | None) -> None:
    """requests.json: as read by the caller on the engine's thread (a stall's bundle), else read from this thread: a
    bundle is written while the engine's step waits on a rank, or between steps."""
    if requests is None:
        try:
            requests = read_requests(engine)
        except Exception as e:   # a step changed the scheduler as it was read
            requests = {"error": f"{type(e).__name__}: {e}"}
    _write_json(d / "requests.json", requests)


def _fr_files(d: Path) -> None:
    """fr/: the ranks' ledgers (as the bundle's rank<R>/collectives.json hold them) in Flight Recorder's format."""
    from devharness.diagnostics.torch_fr import write_dumps
    ledgers = {}
    for path in sorted(d.glob("rank*/collectives.json")):
        try:
            led = read_ledger(path.read_bytes())
        except ValueError:
            continue   # the rank's ledger could not be read: its file says why
        if led.groups:
            ledgers[led.rank] = led
    if ledgers:
        try:
            write_dumps(ledgers, d / "fr")
        except Exception as e:
            logger.warning("bundle %s: no fr/ (%s: %s)", d, type(e).__name__, e)


class BundleWriter:
    """Writes the bundles of one engine (an LLMEngine): one at a time, each in a new directory under
    `config.bundle_dir`. Its last path is in the engine's stats, for the server and the TUI."""

    def __init__(self, engine):
        self.engine = engine
        self.root = Path(engine.config.bundle_dir) if engine.config.bundle_dir else default_dir()
        self.paths: list[Path] = []
        self._lock = threading.Lock()
        self._monitor = None

    @property
    def last(self) -> str | None:
        return str(self.paths[-1]) if self.paths else None

    def requests_now(self) -> dict:
        """The requests' stories and stalls as requests.json holds them, read now (on the engine's thread, between
        steps), for a bundle written later from another thread."""
        return read_requests(self.engine)

    def write(self, reason: str, error: str | None = None, hang=None, stalls: list | None = None,
              requests: dict | None = None, engine_stats: dict | None = None, numerics=None) -> Path:
        """A new bundle; `hang` is the detector's HangEvent, `error` a worker error's text, `stalls` the stalls
        (protocol/messages.py Stall) it is for, `numerics` every rank's NumericsReport (the numerics check's last
        steps, for numerics.json). `requests` (requests.json's content, as requests_now reads it) and `engine_stats`
        (LLMEngine.stats()): as read on the engine's thread by a caller that writes the bundle from another while the
        engine steps on; else read here."""
        with self._lock:
            path = self._write(reason, error, hang, stalls, requests, engine_stats)
            if numerics:
                from devharness.debug.numerics import to_json
                _write_json(path / "numerics.json", to_json(numerics))
                _seal(path)
            self.paths.append(path)
        logger.warning("bundle written (%s): %s", reason, path)
        return path

    def _write(self, reason: str, error: str | None, hang, stalls: list | None, requests: dict | None,
               engine_stats: dict | None) -> Path:
        from devharness.diagnostics.hang import hang_report
        from devharness.diagnostics.workers import WorkerMonitor
        engine, cfg = self.engine, self.engine.config
        flight = engine.flight_recorder
        if flight is not None:
            held, steps, partial = flight.window()
        else:
            held, steps, partial = [], [], False
        failing = next((s.scheduler_output.step for s in steps if s.error_kind is not None), None)
        step = steps[-1].scheduler_output.step if steps else engine.step_count
        d = _new_dir(self.root, cfg.run_id, step, reason)
        manifest = engine.manifest(partial=partial)   # the engine's: the writer knows no engine module
        if steps:
            write_recording(d, manifest, steps, held)
        report = hang_report(cfg.run_id, cfg.parallel.world_size, step)
        if hang is not None:
            report = f"detected: {hang.describe()}\n\n{report}"
        _write_text(d / "hang.txt", report + "\n")
        _requests_file(engine, d, requests)
        _driver_file(engine, d)
        if self._monitor is None:
            self._monitor = WorkerMonitor(engine)
        with ThreadPoolExecutor(max_workers=4) as pool:   # py-spy per rank: in parallel
            list(pool.map(lambda r: _worker_files(self._monitor, r, d / f"rank{r}"),
                          range(cfg.parallel.world_size)))
        _fr_files(d)
        summary = {
            "reason": reason, "time": time.time(), "run_id": cfg.run_id, "error": error,
            "hang": None if hang is None else {"description": hang.describe(), "kind": hang.kind, "step": hang.step,
                                               "group": hang.group, "seq": hang.seq, "op": hang.op,
                                               "waiting": list(hang.waiting), "where": hang.where,
                                               "since": hang.since, "detected": hang.detected,
                                               "missing": [{"rank": b.rank, "why": b.why} for b in hang.missing]},
            "stalls": stalls or [],
            "steps": [s.scheduler_output.step for s in steps[:1] + steps[-1:]] if steps else [],
            "num_steps": len(steps), "failing_step": failing, "replay": f"devharness replay {d}" if steps else None,
            "engine": engine_stats if engine_stats is not None else engine.stats(), "config": msgspec.to_builtins(cfg),
            "kernels": manifest.kernels, "weights": msgspec.to_builtins(manifest.weights), "versions": manifest.versions,
        }
        _write_json(d / BUNDLE_JSON, summary)
        _seal(d)
        return d

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
