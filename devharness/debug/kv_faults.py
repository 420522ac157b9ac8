"""The KV faults of `--inject` (debug/faults.py parses them), planted on the driver's block manager from outside:
its methods wrapped on the one instance, so that the KV sanitizer (engine/kv_cache.py BlockManager.check) can be
shown to name what was planted.

    kv-use-after-free:step=N   in step N, the next allocation that takes a block from the free queue first frees
                               the last block of another running request (its table still lists it), so that the
                               block is handed to two requests at once
    kv-leak:step=N             the first request freed in step N or later (finished, not preempted) keeps its
                               blocks: its table is never released
    kv-stale-hit[:step=N]      the first block evicted from the prefix cache in step N or later (default: any
                               step) keeps its old hash there while it is re-filled with other tokens: a later
                               prompt with that prefix hits the block and reads the other tokens' keys and
                               values (a phantom hit). The block's bookkeeping is right: only its contents are
                               wrong, for the KV checksums and `check --prefix-cache` to find
"""
from __future__ import annotations

import logging

from devharness.debug.faults import FaultSpec

logger = logging.getLogger(__name__)
KV_KINDS = ("kv-use-after-free", "kv-leak", "kv-stale-hit")


def install(spec: FaultSpec, scheduler) -> bool:
    """Plant `spec` on `scheduler`'s block manager if it is a KV fault; whether it did. A block manager made anew
    (after a worker restart) starts clean."""
    if spec.kind not in KV_KINDS:
        return False
    bm = scheduler.block_manager
    done = [False]
    if spec.kind == "kv-use-after-free":
        real = bm.allocate_slots

        def allocate_slots(req, num_new_tokens, computed_blocks=()):
            held = len(bm.req_blocks.get(req.req_id, [])) + len(computed_blocks)
            computed = req.num_computed_tokens + len(computed_blocks) * bm.block_size
            takes_a_block = -(-(computed + num_new_tokens) // bm.block_size) > held
            if not done[0] and bm.step >= spec.step and takes_a_block:
                victim = next((rid for rid, blocks in bm.req_blocks.items() if rid != req.req_id and blocks), None)
                if victim is not None:
                    b = bm.req_blocks[victim][-1]
                    bm.ref_counts[b] -= 1
                    if bm.ref_counts[b] == 0:   # to the front: the next block handed out
                        bm.free_queue[b] = None
                        bm.free_queue.move_to_end(b, last=False)
                        done[0] = True
                        logger.warning("planted kv-use-after-free: step %d frees block %d of request %s, which "
                                       "still holds it, and hands it to request %s", bm.step, b, victim, req.req_id)
            return real(req, num_new_tokens, computed_blocks)
        bm.allocate_slots = allocate_slots
    elif spec.kind == "kv-stale-hit":
        real = bm.allocate_slots

        def allocate_slots(req, num_new_tokens, computed_blocks=()):
            if done[0] or bm.step < (spec.step or 0):
                return real(req, num_new_tokens, computed_blocks)
            cached = dict(bm.cached)   # hash -> block, before this allocation evicts any
            handed = real(req, num_new_tokens, computed_blocks)
            for b in handed or ():
                h = next((h for h, old in cached.items() if old == b and bm.cached.get(h) != b), None)
                if h is not None:
                    bm.cached[h] = b   # the eviction forgotten: the old prefix now names the re-filled block
                    done[0] = True
                    logger.warning("planted kv-stale-hit: step %d hands block %d to request %s but keeps its old "
                                   "hash %016x in the prefix cache", bm.step, b, req.req_id, h & 0xFFFFFFFFFFFFFFFF)
                    break
            return handed
        bm.allocate_slots = allocate_slots
    else:
        real_free = bm.free

        def free(req, kind="free"):
            if not done[0] and kind == "free" and bm.step >= spec.step and req.status.finished \
                    and bm.req_blocks.get(req.req_id):
                done[0] = True
                logger.warning("planted kv-leak: step %d keeps blocks %s of finished request %s", bm.step,
                               bm.req_blocks[req.req_id], req.req_id)
                return None   # the blocks stay with the finished request
            return real_free(req, kind)
        bm.free = free
    return True


def uninstall(scheduler) -> None:
    """Take away what install() planted on `scheduler`'s block manager (its methods are the class's again)."""
    for name in ("allocate_slots", "free"):
        scheduler.block_manager.__dict__.pop(name, None)
