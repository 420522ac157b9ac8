"""The wire's JSON: the /debug types as a `serve --debug` server sends them (the TUI, `devharness kv`, `devharness
collectives --url`) and as a bundle keeps them (rank<R>/collectives.json). One decoder per type; each reads number
types leniently (strict=False), so a server or bundle of another version still decodes (tests/test_layout.py holds
every other module to using these)."""
from __future__ import annotations

import msgspec

from devharness.protocol.messages import (BundleWritten, DriverTimeline, EngineStats, KvSnapshot, Ledger,
                                         RequestStory, RequestsSnapshot, Snapshot, StepRecord, WorkerState)


class History(msgspec.Struct):
    """GET /debug/workers/{rank}/history: one rank's last steps. Records are objects; the array form of the older,
    array_like StepRecord is read too."""

    steps: list[StepRecord | tuple[int, dict[str, float], float | None, int | None]]


snapshot_decoder = msgspec.json.Decoder(Snapshot, strict=False)
kv_decoder = msgspec.json.Decoder(KvSnapshot, strict=False)
requests_decoder = msgspec.json.Decoder(RequestsSnapshot, strict=False)
story_decoder = msgspec.json.Decoder(RequestStory, strict=False)
ledger_decoder = msgspec.json.Decoder(Ledger, strict=False)
history_decoder = msgspec.json.Decoder(History, strict=False)
bundle_written_decoder = msgspec.json.Decoder(BundleWritten, strict=False)
step_records_decoder = msgspec.json.Decoder(list[StepRecord], strict=False)   # a bundle's rank<R>/history.json
worker_state_decoder = msgspec.json.Decoder(WorkerState, strict=False)       # a bundle's rank<R>/state.json
driver_decoder = msgspec.json.Decoder(DriverTimeline, strict=False)   # GET /debug/driver, a bundle's driver.json


def read_ledger(data: bytes | str) -> Ledger:
    """One rank's collective ledger; msgspec.DecodeError (a ValueError) where `data` is truncated or not one."""
    return ledger_decoder.decode(data)


def read_history(data: bytes | str) -> list[StepRecord]:
    """A history reply's steps, each a StepRecord (the older array form converted); ValueError as read_ledger."""
    return [r if isinstance(r, StepRecord) else StepRecord(*r) for r in history_decoder.decode(data).steps]


def engine_stats(stats: dict) -> EngineStats:
    """The engine's stats (LLMEngine.stats(), builtins) as the /debug wire type: the fields it names."""
    return msgspec.convert(stats, EngineStats)
