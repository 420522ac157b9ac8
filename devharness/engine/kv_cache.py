"""BlockManager: which KV-cache blocks each request holds, and the prefix cache of full blocks.

A full block is named by a hash chained over its tokens and every token before it, so equal
prefixes share blocks. Freed blocks keep their hash until reused: the free queue is also the
eviction order (least recently freed first).

It keeps an account of itself for the people debugging it: every allocation, free, prefix-cache lookup,
eviction and preemption is an event (the last KV_EVENTS of them, with their step); each block has a generation
that changes whenever it is taken for new tokens, and each request's table remembers the generation each of its
blocks had when it was handed over; `snapshot()` is the map that GET /debug/kv serves, and `check()` is the KV
sanitizer's test of the manager's invariants (a block freed while a table still holds it, a leak, reference
counts that do not add up).
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from itertools import chain, compress
from dataclasses import dataclass

from devharness.engine.request import Request, RequestStatus
from devharness.protocol.messages import KvEvent, KvRequest, KvSnapshot

KV_EVENTS = 256           # events kept for /debug/kv
EVICTIONS_REMEMBERED = 4096   # evicted hashes remembered, to say why a lookup missed
FULL_CHECK_EVERY = 16     # the sanitizer's checks between two that walk every table block by block


class KvSanitizerError(RuntimeError):
    """The KV sanitizer found the cache in a state it must never be in; the message names the request, the block,
    the step and what was expected."""


@dataclass(frozen=True)
class Lookup:
    """A prefix-cache lookup: the cached blocks found for the longest prefix, how many full blocks could have
    been found, and why the first one that was not found missed."""

    blocks: list[int]
    asked: int
    why_missed: str | None

    def describe(self) -> str:
        if not self.asked:
            return "no full block to look up (the last token is always computed)"
        hit = f"{len(self.blocks)} of {self.asked} full block(s) hit"
        return hit if self.why_missed is None else f"{hit}; block {len(self.blocks)} missed: {self.why_missed}"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.generation = [0] * num_blocks                # + 1 each time the block is taken for new tokens
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}               # chained hash -> block id
        self.req_blocks: dict[str, list[int]] = {}
        self.req_generations: dict[str, list[int]] = {}   # the generation of each block when the table got it
        self.req_hashes: dict[str, list[int]] = {}     # hashes of the request's full blocks, in order
        self.prefix_hit_tokens = 0                     # tokens whose prefill was skipped
        self.prefix_query_tokens = 0                   # tokens of the requests looked up
        self.step = 0                                  # the step being scheduled (the scheduler sets it)
        self.events: deque[KvEvent] = deque(maxlen=KV_EVENTS)
        self.evicted_at: OrderedDict[int, int] = OrderedDict()   # hash -> step it was evicted
        self.touched: set[int] = set()                 # blocks allocated or freed since the sanitizer's last check
        # The tables' own count of each block (entries holding it), kept as tables grow and are freed, apart from
        # ref_counts: what the sanitizer checks a touched block's reference count against without walking tables.
        self.held = [0] * num_blocks
        self.num_held = 0                              # blocks with held > 0
        self.num_checks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_of(self, req_id: str) -> list[int]:
        """The blocks `req_id` holds, in its table's order (none: [])."""
        return self.req_blocks.get(req_id, [])

    def _event(self, kind: str, req_id: str | None, blocks: list[int], detail: str = "") -> None:
        self.events.append(KvEvent(self.step, kind, req_id, list(blocks), detail))

    def _hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        hashes = self.req_hashes.setdefault(req.req_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(req.all_token_ids[i * bs:(i + 1) * bs]))))
        return hashes

    def lookup(self, req: Request) -> Lookup:
        """Cached blocks covering the longest prefix of `req`; always leaves at least one token to compute."""
        if not self.enable_prefix_caching:
            return Lookup([], 0, None)
        hashes = self._hashes(req, (req.num_tokens - 1) // self.block_size)
        hit = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                step = self.evicted_at.get(h)
                return Lookup(hit, len(hashes), "not in the cache" if step is None else
                              f"evicted at step {step}")
            hit.append(b)
        return Lookup(hit, len(hashes), None)

    def record_lookup(self, req: Request, found: Lookup) -> None:
        """A request was admitted with what `found` says: count it (vLLM's prefix-cache queries and hits, in
        tokens) and keep it as an event."""
        if not self.enable_prefix_caching:
            return
        hit_tokens = len(found.blocks) * self.block_size
        self.prefix_query_tokens += req.num_tokens
        self.prefix_hit_tokens += hit_tokens
        self._event("lookup", req.req_id, found.blocks, f"{found.describe()} ({hit_tokens} of {req.num_tokens} "
                                                          f"tokens)")

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> list[int] | None:
        """Blocks for `num_new_tokens` more tokens (after `computed_blocks`, for a request starting now).
        Returns the newly allocated block ids, or None (and changes nothing) if too few are free."""
        held = self.req_blocks.get(req.req_id, [])
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(held) - len(computed_blocks)
        reused_free = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)
        if needed > self.num_free_blocks - reused_free:
            return None
        for b in computed_blocks:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1
        new = []
        for _ in range(max(needed, 0)):
            b, _ = self.free_queue.popitem(last=False)
            if self.block_hash[b] is not None:   # evict its old prefix-cache entry
                h = self.block_hash[b]
                if self.cached.get(h) == b:
                    del self.cached[h]
                    self.evicted_at[h] = self.step
                    self.evicted_at.move_to_end(h)
                    if len(self.evicted_at) > EVICTIONS_REMEMBERED:
                        self.evicted_at.popitem(last=False)
                    self._event("evict", req.req_id, [b], f"cached prefix {h & 0xFFFFFFFFFFFFFFFF:016x} evicted")
                self.block_hash[b] = None
            self.ref_counts[b] = 1
            self.generation[b] += 1
            new.append(b)
        handed = list(computed_blocks) + new
        self.req_blocks[req.req_id] = held + handed
        if handed:   # most decode steps hand nothing: the tables' generations and counts grow only with their blocks
            self.touched.update(handed)
            tables_hold = self.held
            for b in handed:
                if not tables_hold[b]:
                    self.num_held += 1
                tables_hold[b] += 1
            self.req_generations.setdefault(req.req_id, []).extend(self.generation[b] for b in handed)
            self._event("allocate", req.req_id, handed,
                        f"{len(computed_blocks)} from the prefix cache" if computed_blocks else "")
        return handed

    def cache_full_blocks(self, req: Request) -> None:
        """Publish the request's blocks that are full and computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks.get(req.req_id, [])
        num_full = min(req.num_computed_tokens // self.block_size, len(blocks))
        for h, b in zip(self._hashes(req, num_full), blocks[:num_full]):
            if self.block_hash[b] is None and h not in self.cached:
                self.block_hash[b] = h
                self.cached[h] = b

    def forget_block(self, b: int, why: str) -> None:
        """Take block `b` out of the prefix cache (its contents are not what its hash names): no later prompt hits
        it. A request holding it keeps it until it ends."""
        names = [h for h, block in self.cached.items() if block == b]
        for h in names:
            del self.cached[h]
        if self.ref_counts[b] == 0:
            self.block_hash[b] = None
        if names:
            self._event("evict", None, [b], f"{why}: {len(names)} cached prefix(es) dropped")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, so that the next prompts are computed whole (benchmarks that run one workload
        again, as vLLM's do). Only while no request holds a block; whether it did."""
        if self.num_used_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    def free(self, req: Request, kind: str = "free") -> None:
        """Release the request's blocks; its tail blocks become the first to be evicted. `kind`: the event it is
        (free, preempt)."""
        blocks = self.req_blocks.pop(req.req_id, [])
        self.req_generations.pop(req.req_id, None)
        self.touched.update(blocks)
        tables_hold = self.held
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None
            tables_hold[b] -= 1
            if not tables_hold[b]:
                self.num_held -= 1
        self.req_hashes.pop(req.req_id, None)
        if blocks or kind != "free":
            self._event(kind, req.req_id, blocks)

    # -- what the debugging tools see -----------------------------------------------------------

    def snapshot(self, step: int, requests: list[tuple[Request, str]], preemptions: int,
                 sanitizer: bool) -> KvSnapshot:
        """The map: every block's reference count, hash and generation, `requests` ((request, status) pairs)
        with their tables, and the last events."""
        used = self.num_used_blocks
        return KvSnapshot(
            step=step, num_blocks=self.num_blocks, block_size=self.block_size,
            prefix_caching=self.enable_prefix_caching, num_free=self.num_free_blocks, num_used=used,
            num_cached=sum(1 for b in self.free_queue if self.block_hash[b] is not None),
            usage=used / self.num_blocks, ref_counts=list(self.ref_counts),
            hashes=[None if h is None else f"{h & 0xFFFFFFFFFFFFFFFF:016x}" for h in self.block_hash],
            generations=list(self.generation),
            requests=[KvRequest(r.req_id, status, list(self.req_blocks.get(r.req_id, [])), r.num_computed_tokens,
                                r.num_tokens, (r.num_cached_tokens or 0) // self.block_size) for r, status in requests],
            events=list(self.events), prefix_queries=self.prefix_query_tokens, prefix_hits=self.prefix_hit_tokens,
            preemptions=preemptions, sanitizer=sanitizer)

    def check(self, live: dict[str, Request]) -> None:
        """The KV sanitizer: raise KvSanitizerError on the first broken invariant. `live`: the requests that may
        hold blocks (the running ones). Every table belongs to a live request; each block it holds still has the
        generation it had when the table got it (else it was freed and taken by another: a use after free); a
        block's reference count is the number of tables that hold it; a block is in two tables only as a shared
        cached prefix; the free blocks are exactly those no table holds, and free + used = total.

        Every check tests the tables' requests, and each block allocated or freed since the last check against the
        tables' own count of it (`held`): its reference count, its cached prefix if shared, free or not; so a block
        handed out while a table still holds it (a use after free: its reference count restarts at 1) or one freed
        under a table is named in the step it happens, at a cost of what changed, not of what the tables hold.
        Every FULL_CHECK_EVERY-th check walks every table block by block as well (the generations, every count,
        `held` itself), which finds within as many checks what changed the manager's state without going through
        its methods. What is broken is named by _explain, block by block."""
        self.num_checks += 1
        full = self.num_checks % FULL_CHECK_EVERY == 0
        if not (self._sound(live) if full else self._sound_since_last_check(live)):
            self._explain(live)
            self._explain_held()
        self.touched = set()

    def _sound_since_last_check(self, live: dict[str, Request]) -> bool:
        """Whether the tables' requests are live and running, and each block allocated or freed since the last check
        holds what the tables' count of it says (check())."""
        running = RequestStatus.RUNNING
        for rid in self.req_blocks:
            req = live.get(rid)
            if req is None or req.status is not running:
                return False
        free = self.free_queue
        if self.touched:
            held, refs, hashes = self.held, self.ref_counts, self.block_hash
            for b in self.touched:
                n = held[b]
                if refs[b] != n or (n > 1 and hashes[b] is None) or (b in free) == (n > 0):
                    return False
        return len(free) + self.num_held == self.num_blocks

    def _sound(self, live: dict[str, Request]) -> bool:
        """Whether every invariant of check() holds: the same tests as _explain, with the loops over blocks in C
        (map, Counter, compress, set operations) and one line of Python per table."""
        gen, tables, handed = self.generation.__getitem__, self.req_blocks, self.req_generations
        running = RequestStatus.RUNNING
        for rid, blocks in tables.items():
            req = live.get(rid)
            if req is None or req.status is not running:
                return False
            g = handed.get(rid, [])
            if list(map(gen, blocks if len(g) == len(blocks) else blocks[:len(g)])) != g:
                return False
        held = list(chain.from_iterable(tables.values()))
        counts = Counter(held)
        refs = self.ref_counts
        if list(map(refs.__getitem__, counts)) != list(counts.values()):
            return False
        if len(counts) < len(held):   # a block in two tables or more: each must hold a cached prefix
            shared = compress(counts, map((1).__lt__, counts.values()))
            if None in map(self.block_hash.__getitem__, shared):
                return False
        free = self.free_queue
        if len(free) + len(counts) != self.num_blocks or not free.keys().isdisjoint(counts):
            return False
        if self.num_held != len(counts) or list(map(self.held.__getitem__, counts)) != list(counts.values()):
            return False
        return not any(refs[b] for b in self.touched if b not in counts)

    def _explain(self, live: dict[str, Request]) -> None:
        """check()'s tests block by block: raise KvSanitizerError naming the first broken invariant, its request,
        block and step."""
        at = f"KV sanitizer, step {self.step}"
        gen = self.generation
        for rid, blocks in self.req_blocks.items():
            req = live.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                state = "it has finished or was aborted" if req is None else f"it is {req.status.value}"
                raise KvSanitizerError(f"{at}: request {rid} still holds blocks {blocks} but {state}: expected its "
                                       f"blocks freed (a leak)")
            handed = self.req_generations.get(rid, [])
            if [gen[b] for b in blocks[:len(handed)]] != handed:
                b, g = next((b, g) for b, g in zip(blocks, handed) if gen[b] != g)
                last = next((e for e in reversed(self.events) if e.kind == "allocate" and b in e.blocks
                             and e.request != rid), None)
                taken = "" if last is None else f"; taken for request {last.request} at step {last.step}"
                raise KvSanitizerError(f"{at}: request {rid} reads block {b}, handed to it at generation {g}, "
                                       f"but the block is at generation {gen[b]}: it was freed and reused while "
                                       f"the request held it (a use after free{taken})")
        counts = Counter(chain.from_iterable(self.req_blocks.values()))
        refs = self.ref_counts
        for b, n in counts.items():
            if refs[b] != n or (n > 1 and self.block_hash[b] is None):
                rids = [rid for rid, blocks in self.req_blocks.items() if b in blocks]
                if refs[b] != n:
                    raise KvSanitizerError(f"{at}: block {b} has reference count {refs[b]} but {n} table(s) hold "
                                           f"it ({', '.join(rids)})")
                raise KvSanitizerError(f"{at}: block {b} is in the tables of requests {', '.join(rids)} but holds "
                                       f"no cached prefix: expected a block to be shared only through the prefix "
                                       f"cache")
        free = self.free_queue
        if both := [b for b in counts if b in free]:
            b = both[0]
            raise KvSanitizerError(f"{at}: block {b} is in the free queue but {counts[b]} table(s) hold it")
        # The blocks no table holds: all free (counted), each with reference count 0 (those touched since the last
        # check; the others were checked when they last changed).
        if len(self.free_queue) + len(counts) != self.num_blocks:
            b = next(b for b in range(self.num_blocks) if b not in counts and b not in self.free_queue)
            raise KvSanitizerError(f"{at}: block {b} has reference count {refs[b]} but no table holds it and it is "
                                   f"not free: expected it freed (a leak); {len(self.free_queue)} free + "
                                   f"{len(counts)} held != {self.num_blocks} blocks")
        touched, self.touched = self.touched, set()
        for b in touched:
            if b not in counts and refs[b]:
                raise KvSanitizerError(f"{at}: block {b} is free but has reference count {refs[b]}: expected 0")

    def _explain_held(self) -> None:
        """The invariants hold but the tables' own count of their blocks does not match them: raise naming the block
        (the tables changed without allocate_slots or free)."""
        counts = Counter(chain.from_iterable(self.req_blocks.values()))
        b = next((b for b in range(self.num_blocks) if self.held[b] != counts.get(b, 0)), None)
        what = (f"{self.num_held} blocks counted as held, {len(counts)} in the tables" if b is None else
                f"block {b} is counted in {self.held[b]} table(s) but {counts.get(b, 0)} hold it")
        raise KvSanitizerError(f"KV sanitizer, step {self.step}: the block tables changed without allocate_slots or "
                               f"free: {what}")
