"""BlockManager: allocation, freeing, prefix sharing and eviction."""
from devharness.engine.kv_cache import BlockManager
from devharness.engine.request import Request
from devharness.sampling_params import SamplingParams


def req(rid, n, start=0):
    return Request(rid, list(range(start, start + n)), SamplingParams(), 0, (), 10_000)


def test_allocate_and_free_counts():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = req("a", 9)
    assert len(bm.allocate_slots(a, 9)) == 3
    assert bm.num_free_blocks == 7
    a.num_computed_tokens = 9
    assert bm.allocate_slots(a, 3) == []          # tokens 10..12 still fit in block 3
    assert len(bm.allocate_slots(a, 4)) == 1
    big = req("b", 40)
    assert bm.allocate_slots(big, 40) is None     # all or nothing
    assert bm.num_free_blocks == 6
    bm.free(a)
    assert bm.num_free_blocks == 10


def test_prefix_blocks_shared_after_compute_and_evicted_last_used_last():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = req("a", 10)
    blocks_a = bm.allocate_slots(a, 10)
    assert bm.lookup(req("x", 10)).blocks == []     # nothing is shared before it is computed
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    b = req("b", 10)                                      # same tokens
    hit = bm.lookup(b).blocks
    assert hit == blocks_a[:2]                            # two full blocks; the partial one is not shared
    new = bm.allocate_slots(b, 2, hit)
    assert new[:2] == hit and len(new) == 3
    assert bm.ref_counts[hit[0]] == 2
    c = req("c", 10, start=1)                             # different tokens: no hit
    assert bm.lookup(c).blocks == []
    bm.free(a)
    bm.free(b)
    # Freed but still cached: a later identical request hits them again.
    assert bm.lookup(req("d", 10)).blocks == blocks_a[:2]
    # Filling the cache with other requests evicts them.
    e = req("e", 32, start=100)
    assert len(bm.allocate_slots(e, 32)) == 8
    assert bm.lookup(req("f", 10)).blocks == []


def test_whole_prompt_cached_still_computes_last_token():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = req("a", 8)
    bm.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    assert len(bm.lookup(req("b", 8)).blocks) == 1   # block 2 holds the last token: recomputed for logits


def test_reset_prefix_cache_forgets_prefixes_only_when_no_request_holds_blocks():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = req("a", 10)
    blocks_a = bm.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    assert bm.reset_prefix_cache() is False                   # a holds blocks: nothing changes
    assert bm.lookup(req("b", 10)).blocks == blocks_a[:2]
    bm.free(a)
    assert bm.lookup(req("c", 10)).blocks == blocks_a[:2]   # freed, still cached
    assert bm.reset_prefix_cache() is True
    assert bm.lookup(req("d", 10)).blocks == []
    assert bm.num_free_blocks == 8 and bm.allocate_slots(req("e", 32, start=100), 32) is not None
