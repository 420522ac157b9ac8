"""Each request's story as text: `devharness requests --url URL [ID]` prints a `serve --debug` server's GET
/debug/requests (one row a request, oldest first, why it waits) or GET /debug/requests/{ID} (its story). No torch."""
from __future__ import annotations

import time

from devharness.protocol.messages import RequestsSnapshot, RequestStory


def render_list(snap: RequestsSnapshot, now: float | None = None) -> str:
    now = now or snap.time or time.time()
    lines = [f"requests at step {snap.step}{' (engine paused)' if snap.paused else ''}: "
             f"{sum(r.state in ('waiting', 'preempted') for r in snap.requests)} waiting, "
             f"{sum(r.state == 'running' for r in snap.requests)} running",
             f"  {'request':<24} {'state':<9} {'age s':>8} {'queued s':>8} {'preempt':>7}  why it waits"]
    for r in snap.requests:
        why = f"{r.waiting_reason.code}: {r.waiting_reason.detail}" if r.waiting_reason else (r.finish_reason or "")
        lines.append(f"  {r.request_id:<24} {r.state:<9} {now - r.arrival_time:>8.2f} {r.queued_s:>8.2f} "
                     f"{r.num_preemptions:>7}  {why}")
    if not snap.requests:
        lines.append("  none")
    lines.append(f"stalls: {len(snap.stalls) or 'none'}")
    for s in snap.stalls:
        lines.append(f"  step {s.step:>6}  {s.kind:<11} request {s.request_id}: {s.detail} (reason: {s.reason})")
    return "\n".join(lines)


def render_story(story: RequestStory) -> str:
    why = story.waiting_reason
    lines = [f"request {story.request_id}: {story.state}"
             + (f" ({why.code}: {why.detail})" if why else "")
             + (f", finished: {story.finish_reason}" if story.finish_reason else ""),
             f"  {story.num_prompt_tokens} prompt tokens, {story.num_output_tokens} output; {story.prefix_hit_tokens} "
             f"from the prefix cache; queued {story.queued_s:.2f} s; {story.num_preemptions} preemption(s)"]
    for e in story.events:
        steps = f"{e.step}..{e.last_step}" if e.last_step is not None and e.last_step != e.step else str(e.step)
        extra = [f"{e.tokens} tokens" if e.tokens is not None else "", f"{e.blocks} blocks freed"
                 if e.blocks is not None else "", f"{e.count} steps" if e.count > 1 else ""]
        lines.append(f"  step {steps:>11}  {e.kind:<11} " + "; ".join(x for x in [*extra, e.detail] if x))
    return "\n".join(lines)


def requests_main(args) -> int:
    """`devharness requests --url URL [ID] [--json]`: the server's requests and why they wait, or one's story."""
    import httpx
    import msgspec

    from devharness.protocol.json_codecs import requests_decoder, story_decoder
    url = args.url.rstrip("/")
    route = f"/debug/requests/{args.request_id}" if args.request_id else "/debug/requests"
    token = getattr(args, "token", None)
    try:
        r = httpx.get(f"{url}{route}", timeout=30, headers={"Authorization": f"Bearer {token}"} if token else {})
    except httpx.HTTPError as e:
        raise ValueError(f"{url}: cannot reach the server ({type(e).__name__}: {e})") from None
    if r.status_code == 401:
        raise ValueError(f"{url} needs its debug token: pass --token T or set DEVHARNESS_DEBUG_TOKEN")
    if r.status_code == 404:
        try:
            error = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            error = {}
        if isinstance(error, dict) and error.get("code") == "request_not_found":
            raise ValueError(f"{url}: {error.get('message')}")
        raise ValueError(f"{url} has no /debug/requests: start the server with --debug")
    if r.status_code != 200:
        raise ValueError(f"{url}{route} answered {r.status_code}: {r.text[:200]}")
    try:
        body = (story_decoder if args.request_id else requests_decoder).decode(r.content)
    except msgspec.DecodeError as e:
        raise ValueError(f"{url}{route} did not answer with requests: {e}") from None
    print(r.text if args.json else render_story(body) if args.request_id else render_list(body))
    return 0
