"""`devharness collectives BUNDLE | --url URL`: the ranks' collective ledgers side by side.

One table per group and kind (collectives, p2p ops): a row per sequence number, a column per rank of the group,
each cell the op that rank made there (op, shape, dtype, site; `…` while not completed). The first row where the
ranks disagree (another op, shape, dtype or site) or where some have not arrived is marked. Read from a bundle's
rank<R>/collectives.json or from a `serve --debug` server's /debug/workers/{rank}/collectives; no torch here.
"""
from __future__ import annotations

from pathlib import Path

import msgspec

from devharness.diagnostics.hang import op_signature
from devharness.protocol.json_codecs import read_ledger, snapshot_decoder
from devharness.protocol.messages import Ledger, LedgerEntry

DEFAULT_ROWS = 12


def read_bundle(path: str | Path) -> dict[int, Ledger]:
    """Every rank's ledger in bundle `path`; ValueError naming what is missing or unreadable."""
    d = Path(path)
    if not d.is_dir():
        raise ValueError(f"{path}: no such bundle directory")
    files = sorted(d.glob("rank*/collectives.json"))
    if not files:
        raise ValueError(f"{path}: not a bundle with collective ledgers (no rank*/collectives.json)")
    ledgers = {}
    for f in files:
        try:
            led = read_ledger(f.read_bytes())
        except ValueError as e:
            raise ValueError(f"{f}: truncated or not a collective ledger ({str(e).splitlines()[0]})") from None
        ledgers[led.rank] = led
    return ledgers


def read_debug_server(url: str, token: str | None, per_rank: dict) -> tuple[dict, dict[str, dict]]:
    """The workers of the `serve --debug` server at `url` ({rank: WorkerState}), and for each route of `per_rank`
    (its name under /debug/workers/{rank}/ -> the decoder of its reply) every rank's reply, decoded; a ValueError
    naming what is wrong (no server, no --debug, a token needed, not devharness)."""
    import httpx
    url = url.rstrip("/")
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.get(f"{url}/debug/workers", timeout=30, headers=auth)
        if r.status_code == 401:
            raise ValueError(f"{url} needs its debug token: pass --token T or set DEVHARNESS_DEBUG_TOKEN")
        if r.status_code != 200:
            raise ValueError(f"{url}/debug/workers answered {r.status_code}: start the server with --debug")
        states = {w.rank: w for w in snapshot_decoder.decode(r.content).workers}
        replies: dict[str, dict] = {route: {} for route in per_rank}
        for rank in states:
            for route, decode in per_rank.items():
                got = httpx.get(f"{url}/debug/workers/{rank}/{route}", timeout=30, headers=auth)
                got.raise_for_status()
                replies[route][rank] = decode(got.content)
        return states, replies
    except httpx.HTTPError as e:
        raise ValueError(f"{url}: {type(e).__name__}: {e}") from None
    except (msgspec.DecodeError, KeyError) as e:
        raise ValueError(f"{url}: not a devharness debug server ({e})") from None


def read_url(url: str, token: str | None = None) -> dict[int, Ledger]:
    return read_debug_server(url, token, {"collectives": read_ledger})[1]["collectives"]


def _cell(e: LedgerEntry | None) -> str:
    if e is None:
        return "-"
    peer = f" {'to' if e.op == 'send' else 'from'} {e.peer}" if e.peer is not None else ""
    shape = "x".join(map(str, e.in_shape))
    return f"{e.op}{peer} {shape} {e.in_dtype} {e.where()}" + ("" if e.state == "completed" else " …")


def render(ledgers: dict[int, Ledger], rows: int = DEFAULT_ROWS) -> str:
    """The tables; the last `rows` sequence numbers of each, and the first disagreement wherever it is."""
    groups: dict[str, tuple[str, list[int]]] = {}
    for led in ledgers.values():
        for g in led.groups:
            groups.setdefault(g.name, (g.desc, sorted(g.ranks)))
    out = []
    for name, (desc, ranks) in sorted(groups.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
        for p2p in (False, True):
            by_rank = {r: {e.seq: e for e in ledgers[r].entries if e.group == name and (e.op in ("send", "recv")) == p2p}
                       for r in ranks if r in ledgers}
            if not any(by_rank.values()):
                continue
            lows = [min(s) for s in by_rank.values() if s]
            seqs = sorted({q for s in by_rank.values() for q in s if q >= max(lows)})
            first_bad, why = None, ""
            for q in seqs:
                got = {r: s.get(q) for r, s in by_rank.items()}
                absent = [r for r, e in got.items() if e is None]
                if absent:
                    first_bad, why = q, "not reached by rank " + ", ".join(map(str, absent))
                    break
                if len({op_signature(e) for e in got.values()}) > 1:
                    first_bad, why = q, "the ranks disagree"
                    break
            shown = seqs[-rows:]
            if first_bad is not None and first_bad not in shown:
                shown = [first_bad] + shown
            kind = "p2p op" if p2p else "collective"
            missing = [r for r in ranks if r not in ledgers]
            out.append(f"group {desc} (torch name {name!r}, ranks {ranks}), by {kind}"
                       + (f"; no ledger from rank {missing}" if missing else ""))
            cols = [f"rank {r}" for r in by_rank]
            table = [[str(q), *(_cell(by_rank[r].get(q)) for r in by_rank)] for q in shown]
            widths = [max(len(x) for x in col) for col in zip(["seq", *cols], *table)]
            line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()   # noqa: E731
            out.append(line(["seq", *cols]))
            for row in table:
                mark = f"   <-- first: {why}" if row[0] == str(first_bad) else ""
                out.append(line(row) + mark)
            if first_bad is None:
                out.append(f"(the ranks agree at all {len(seqs)} sequence numbers their ledgers share)")
            out.append("")
    return "\n".join(out).rstrip() + "\n" if out else "no collectives in the ledgers\n"


def collectives_main(args) -> int:
    if (args.bundle is None) == (args.url is None):
        raise ValueError("collectives needs a BUNDLE directory or --url URL (one of them)")
    ledgers = read_bundle(args.bundle) if args.bundle is not None else read_url(args.url, args.token)
    print(render(ledgers, args.rows), end="")
    return 0
