"""The ranks' collective ledgers in PyTorch Flight Recorder's dump format, for its analyzer.

A bundle's `fr/` holds one file per rank, `rank_<R>`: the pickled dict Flight Recorder dumps (version, pg_config,
pg_status, entries), written from that rank's ledger (debug/ledger.py), so that

    python -m torch.distributed.flight_recorder.fr_trace BUNDLE/fr

matches the ranks' collectives by sequence number and names a missing rank or a mismatch, as it does for NCCL's
own dumps. Group names are the ones torch gave the groups, the same in pg_config and in every entry (torch's
gloo dumps name the world '' in one and '0' in the other, which the analyzer cannot join).

Each rank's ring keeps its newest entries; where the ranks of a group kept different spans of it, every rank's
entries of that group start from the first sequence number all of them still hold, and record ids count from
0 in each file, so the analyzer's alignment (by record id) drops nothing more.
"""
from __future__ import annotations

import pickle
from pathlib import Path

from devharness.protocol.messages import Ledger, LedgerEntry

VERSION = "2.10"      # the dump format this writes (torch 2.13's own dumps say the same)
FR_DTYPES = {"float32": "Float", "bfloat16": "BFloat16", "float16": "Half", "float64": "Double", "int64": "Long",
             "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte", "bool": "Bool"}
TIMEOUT_MS = 0


def _is_p2p(e: LedgerEntry) -> bool:
    return e.op in ("send", "recv")


def _starts(ledgers: dict[int, Ledger]) -> dict[tuple[str, bool], int]:
    """(group, p2p) -> the first sequence number every member's ring still holds."""
    firsts: dict[tuple[str, bool], dict[int, int]] = {}
    for rank, led in ledgers.items():
        for e in led.entries:
            key = (e.group, _is_p2p(e))
            firsts.setdefault(key, {}).setdefault(rank, e.seq)
    return {key: max(by_rank.values()) for key, by_rank in firsts.items()}


def dump(ledger: Ledger, starts: dict[tuple[str, bool], int] | None = None) -> dict:
    """One rank's Flight Recorder dump."""
    groups = {g.name: g for g in ledger.groups}
    entries = []
    status: dict[str, dict[str, int]] = {}
    kept = [e for e in ledger.entries if starts is None or e.seq >= starts.get((e.group, _is_p2p(e)), 0)]
    for record_id, e in enumerate(kept):
        g = groups[e.group]
        name = f"{ledger.backend}:{e.op}"
        if _is_p2p(e):
            order = sorted(g.ranks)
            me, peer = order.index(ledger.rank), order.index(e.peer)
            name += f" {me}->{peer}" if e.op == "send" else f" {me}<-{peer}"
        entries.append({
            "record_id": record_id, "pg_id": list(groups).index(e.group), "process_group": (g.name, g.desc),
            "collective_seq_id": e.collective_seq, "p2p_seq_id": e.p2p_seq, "op_id": e.record_id + 1,
            "profiling_name": name, "time_created_ns": e.created_ns,
            "input_sizes": [list(e.in_shape)], "input_dtypes": [FR_DTYPES.get(e.in_dtype, e.in_dtype)],
            "output_sizes": [list(e.out_shape)], "output_dtypes": [FR_DTYPES.get(e.out_dtype, e.out_dtype)],
            "state": e.state, "time_discovered_started_ns": e.started_ns or None,
            "time_discovered_completed_ns": e.completed_ns or None, "retired": e.state == "completed",
            "timeout_ms": TIMEOUT_MS, "is_p2p": _is_p2p(e),
            "frames": [{"name": e.where(), "filename": f"<devharness step {e.step}>", "line": 0}],
            "thread_id": "0", "thread_name": "worker",
        })
        if not _is_p2p(e):
            st = status.setdefault(g.name, {"last_enqueued_collective": -1, "last_started_collective": -1,
                                            "last_completed_collective": -1})
            st["last_enqueued_collective"] = e.collective_seq
            if e.started_ns:
                st["last_started_collective"] = e.collective_seq
            if e.completed_ns:
                st["last_completed_collective"] = e.collective_seq
    return {"version": VERSION, "comm_lib_version": "", "entries": entries, "pg_status": status,
            "pg_config": {g.name: {"name": g.name, "desc": g.desc, "ranks": str(list(g.ranks))}
                          for g in ledger.groups}}


def write_dumps(ledgers: dict[int, Ledger], out: Path) -> list[Path]:
    """`out`/rank_<R> for every rank whose ledger was read."""
    out.mkdir(parents=True, exist_ok=True)
    starts = _starts(ledgers)
    paths = []
    for rank, led in sorted(ledgers.items()):
        path = out / f"rank_{rank}"
        path.write_bytes(pickle.dumps(dump(led, starts)))
        paths.append(path)
    return paths
