"""BlockManager: which KV-cache blocks each request holds, and the prefix cache of full blocks.

A full block is named by a hash chained over its tokens and every token before it, so equal
prefixes share blocks. Freed blocks keep their hash until reused: the free queue is also the
eviction order (least recently freed first).
"""
from __future__ import annotations

from collections import OrderedDict

from devharness.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}               # chained hash -> block id
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[int]] = {}     # hashes of the request's full blocks, in order
        self.prefix_hit_tokens = 0                     # tokens whose prefill was skipped

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_of(self, req_id: str) -> list[int]:
        return self.req_blocks.get(req_id, [])

    def _hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        hashes = self.req_hashes.setdefault(req.req_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(req.all_token_ids[i * bs:(i + 1) * bs]))))
        return hashes

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Cached blocks covering the longest prefix of `req`; always leaves at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        hit = []
        for h in self._hashes(req, (req.num_tokens - 1) // self.block_size):
            b = self.cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

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
                if self.cached.get(self.block_hash[b]) == b:
                    del self.cached[self.block_hash[b]]
                self.block_hash[b] = None
            self.ref_counts[b] = 1
            new.append(b)
        self.req_blocks[req.req_id] = held + list(computed_blocks) + new
        return list(computed_blocks) + new

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

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, so that the next prompts are computed whole (benchmarks that run one workload
        again, as vLLM's do). Only while no request holds a block; whether it did."""
        if self.num_used_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    def free(self, req: Request) -> None:
        """Release the request's blocks; its tail blocks become the first to be evicted."""
        for b in reversed(self.req_blocks.pop(req.req_id, [])):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None
        self.req_hashes.pop(req.req_id, None)
