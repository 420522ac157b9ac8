"""The KV cache map as text: `devharness kv --url URL` prints a `serve --debug` server's GET /debug/kv, for a
terminal without the TUI (whose KV view draws the same map from the same functions). No torch here."""
from __future__ import annotations

import string

from devharness.protocol.messages import KvSnapshot

FREE, CACHED, SHARED = ".", "c", "*"
OWNER_MARKS = string.ascii_uppercase + string.ascii_lowercase.replace("c", "") + string.digits
ROW = 64   # blocks a line


def owners(snap: KvSnapshot) -> dict[str, str]:
    """Each request that holds blocks, by id: the mark its blocks get on the map (the order of the snapshot)."""
    marks: dict[str, str] = {}
    for r in snap.requests:
        if r.blocks and r.request not in marks:
            marks[r.request] = OWNER_MARKS[len(marks)] if len(marks) < len(OWNER_MARKS) else "#"
    return marks


def block_marks(snap: KvSnapshot) -> list[str]:
    """One mark a block: free, a free block still holding a cached prefix, the request holding it, or shared
    (held by several requests through the prefix cache)."""
    marks = owners(snap)
    held: dict[int, set[str]] = {}
    for r in snap.requests:
        for b in r.blocks:
            held.setdefault(b, set()).add(r.request)
    out = []
    for b in range(snap.num_blocks):
        if b in held:
            out.append(SHARED if len(held[b]) > 1 else marks[next(iter(held[b]))])
        else:
            out.append(CACHED if snap.hashes[b] is not None else FREE)
    return out


def summary(snap: KvSnapshot) -> str:
    hits = f" ({snap.prefix_hits / snap.prefix_queries:.1%})" if snap.prefix_queries else ""
    return (f"KV cache at step {snap.step}: {snap.num_blocks} blocks of {snap.block_size} tokens; {snap.num_used} "
            f"used, {snap.num_free} free ({snap.num_cached} of them cached prefixes); usage {snap.usage:.1%}\n"
            f"prefix cache {'on' if snap.prefix_caching else 'off'}: {snap.prefix_queries} tokens looked up, "
            f"{snap.prefix_hits} found{hits}; {snap.preemptions} preemption(s); sanitizer "
            f"{'on' if snap.sanitizer else 'off'}")


def render(snap: KvSnapshot, events: int = 20) -> str:
    """The whole map as text: the summary, the blocks a character each, the requests' tables, the last events."""
    marks, cells = owners(snap), block_marks(snap)
    lines = [summary(snap), "",
             f"blocks ({FREE} free, {CACHED} cached prefix, a letter: the request holding it, {SHARED} shared):"]
    for start in range(0, len(cells), ROW):
        row = "".join(cells[start:start + ROW])
        lines.append(f"  {start:>5}  " + " ".join(row[i:i + 8] for i in range(0, len(row), 8)))
    lines += ["", "requests:"]
    for r in snap.requests:
        lines.append(f"  {marks.get(r.request, ' ')}  {r.request:<16} {r.status:<9} {r.num_computed_tokens}/"
                     f"{r.num_tokens} tokens computed, {r.prefix_hit_blocks} prefix block(s) hit, "
                     f"blocks {r.blocks}")
    if not snap.requests:
        lines.append("  none")
    shown = snap.events[-events:] if events else []
    lines += ["", f"last {len(shown)} of {len(snap.events)} events:"]
    for e in shown:
        lines.append(f"  step {e.step:>6}  {e.kind:<8} {e.request or '':<16} {e.blocks if e.blocks else ''} "
                     f"{e.detail}".rstrip())
    return "\n".join(lines)


def kv_main(args) -> int:
    """`devharness kv --url URL [--events N] [--json]`: the server's KV cache map, as text or its JSON."""
    import httpx
    import msgspec

    from devharness.protocol.json_codecs import kv_decoder
    url = args.url.rstrip("/")
    token = getattr(args, "token", None)
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.get(f"{url}/debug/kv", timeout=30, headers=auth)
    except httpx.HTTPError as e:
        raise ValueError(f"{url}: cannot reach the server ({type(e).__name__}: {e})") from None
    if r.status_code == 401:
        raise ValueError(f"{url} needs its debug token: pass --token T or set DEVHARNESS_DEBUG_TOKEN")
    if r.status_code == 404:
        raise ValueError(f"{url} has no /debug/kv: start the server with --debug")
    if r.status_code != 200:
        raise ValueError(f"{url}/debug/kv answered {r.status_code}: {r.text[:200]}")
    try:
        snap = kv_decoder.decode(r.content)
    except msgspec.DecodeError as e:
        raise ValueError(f"{url}/debug/kv did not answer with a KV map: {e}") from None
    print(r.text if args.json else render(snap, args.events))
    return 0
