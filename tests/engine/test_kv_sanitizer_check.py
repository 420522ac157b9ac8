"""The KV sanitizer's test of the block manager (BlockManager.check): each check tests what changed since the last one
against the tables' own count of each block, and every FULL_CHECK_EVERY-th walks every table block by block.

Against the walk alone (the check as it ran at every step before, BlockManager._explain), through a random workload
of prefix hits, decodes, finishes and preemptions: for faults planted as `--inject` plants them (a block freed under a
table and handed out in the same allocation, a finished request's blocks kept), every check raises exactly when the
walk does, with its message. A change made around the manager's methods is named within FULL_CHECK_EVERY checks."""
import random

import pytest

from devharness.engine.kv_cache import FULL_CHECK_EVERY, BlockManager, KvSanitizerError
from devharness.engine.request import Request, RequestStatus
from devharness.sampling_params import SamplingParams

BS = 4


def running(rid: str, tokens: list[int]) -> Request:
    r = Request(rid, tokens, SamplingParams(), 0, (), 10_000)
    r.status = RequestStatus.RUNNING
    return r


def outcome(call) -> str | None:
    try:
        call()
    except KvSanitizerError as e:
        return str(e)
    return None


class Workload:
    """Requests on a 40-block cache with prefix caching, a step at a time (as the scheduler drives the manager)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.bm = BlockManager(num_blocks=40, block_size=BS, enable_prefix_caching=True)
        self.live: dict[str, Request] = {}
        self.prefixes = [[self.rng.randrange(100) for _ in range(2 * BS)] for _ in range(3)]
        self.n = 0
        self.before_allocation = None   # a fault planted right before the next allocation that takes new blocks
        self.leak = False               # the next finished request keeps its blocks

    def allocate(self, r: Request, n: int, hit=()) -> list[int] | None:
        if self.before_allocation is not None and -(-(r.num_computed_tokens + len(hit) * BS + n) // BS) > \
                len(self.bm.blocks_of(r.req_id)) + len(hit):
            self.before_allocation(r)
            self.before_allocation = None
        return self.bm.allocate_slots(r, n, hit)

    def step(self) -> None:
        bm, rng = self.bm, self.rng
        bm.step += 1
        if len(self.live) < 6 and rng.random() < 0.5:
            own = [rng.randrange(100, 200) for _ in range(rng.randrange(1, 7))]
            r = running(f"r{self.n}", (rng.choice(self.prefixes) if rng.random() < 0.6 else []) + own)
            self.n += 1
            found = bm.lookup(r)
            if self.allocate(r, r.num_tokens - len(found.blocks) * BS, found.blocks) is not None:
                r.num_computed_tokens = r.num_tokens
                bm.cache_full_blocks(r)
                self.live[r.req_id] = r
        for r in list(self.live.values()):
            r.all_token_ids.append(rng.randrange(100))
            if self.allocate(r, 1) is None:   # preempted
                r.status = RequestStatus.PREEMPTED
                bm.free(r, "preempt")
                del self.live[r.req_id]
                continue
            r.num_computed_tokens += 1
            bm.cache_full_blocks(r)
            if rng.random() < 0.1:
                r.status = RequestStatus.FINISHED_LENGTH
                del self.live[r.req_id]
                if self.leak:
                    self.leak = False
                else:
                    bm.free(r)

    def plant_use_after_free(self) -> None:
        """As kv-use-after-free plants it: the next allocation that takes a block first frees the last block of
        another request that holds it alone (its table still lists it), to the front of the free queue."""
        def free_under_a_table(taker: Request) -> None:
            bm = self.bm
            for rid, blocks in bm.req_blocks.items():
                if rid != taker.req_id and blocks and bm.ref_counts[blocks[-1]] == 1:
                    bm.ref_counts[blocks[-1]] = 0
                    bm.free_queue[blocks[-1]] = None
                    bm.free_queue.move_to_end(blocks[-1], last=False)
                    return
        self.before_allocation = free_under_a_table


@pytest.mark.parametrize("fault", [None, "use-after-free", "leak"])
def test_each_check_raises_when_the_walk_of_every_table_does(fault):
    named = between_walks = 0
    for seed in range(12):
        w = Workload(seed)
        plant_at = w.rng.randrange(5, 60)
        for step in range(120):
            if step == plant_at and fault == "use-after-free":
                w.plant_use_after_free()
            w.leak |= step == plant_at and fault == "leak"
            w.step()
            touched = set(w.bm.touched)
            walk = outcome(lambda: w.bm._explain(w.live))
            w.bm.touched = touched
            assert outcome(lambda: w.bm.check(w.live)) == walk, (seed, step)
            if walk is not None:
                named += 1
                between_walks += w.bm.num_checks % FULL_CHECK_EVERY != 0   # named by what changed alone
                break
    if fault is None:
        assert named == 0
    else:
        assert named >= 10 and between_walks >= named - 2, (named, between_walks)


def test_a_change_made_around_the_managers_methods_is_named_within_a_full_walk():
    """A shared block's reference count lowered directly (no allocation or free touches it): the tables' count of it
    is checked by the next walk of every table."""
    w = Workload(1)
    while not any(n > 1 for n in w.bm.ref_counts):
        w.step()
        w.bm.check(w.live)
    b = next(b for b, n in enumerate(w.bm.ref_counts) if n > 1)
    w.bm.ref_counts[b] -= 1
    for _ in range(FULL_CHECK_EVERY):
        message = outcome(lambda: w.bm.check(w.live))
        if message is not None:
            break
    assert message is not None and f"block {b} has reference count" in message, message


def test_a_table_changed_without_the_manager_is_named():
    """A block put into a table by hand, reference count, free queue and generations all made to agree: only the
    tables' own count of their blocks says so (free + held no longer adds up: at the next check)."""
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = running("a", list(range(6)))
    bm.allocate_slots(a, 6)
    bm.check({"a": a})
    b = next(iter(bm.free_queue))
    del bm.free_queue[b]
    bm.ref_counts[b] = 1
    bm.req_blocks["a"].append(b)
    bm.req_generations["a"].append(bm.generation[b])
    assert outcome(lambda: bm.check({"a": a})) == (f"KV sanitizer, step 0: the block tables changed without "
                                                   f"allocate_slots or free: block {b} is counted in 0 table(s) but 1 "
                                                   f"hold it")


def test_the_workers_walk_only_the_tables_a_handover_made_stale():
    """A rank's side (ModelRunner._handed, check_kv_generations) on a stand-in runner: a table goes stale when its block
    is handed anew to another request, or when it is handed a block at an older generation than the block's newest;
    the step that schedules it fails naming it, one that does not schedule it does not."""
    from types import SimpleNamespace

    from devharness.worker.model_runner import ModelRunner
    runner = SimpleNamespace(_block_generation={}, _block_refs={}, _stale=set(), requests={},
                             info=SimpleNamespace(rank=0, tp_rank=0, pp_rank=0),
                             model=SimpleNamespace(model=SimpleNamespace(layer_range=(0, 4))))

    def hand(rid: str, blocks: list[int], generations: list[int]) -> None:
        st = runner.requests.setdefault(rid, SimpleNamespace(block_ids=[], block_generations=[]))
        st.block_ids += blocks
        st.block_generations += generations
        ModelRunner._hold_blocks(runner, blocks)
        ModelRunner._handed(runner, rid, blocks, generations)

    def step(*scheduled: str) -> str | None:
        so = SimpleNamespace(step=7, num_scheduled_tokens=dict.fromkeys(scheduled, 1))
        try:
            ModelRunner.check_kv_generations(runner, so)
        except RuntimeError as e:
            return str(e)
        return None

    hand("a", [1, 2], [1, 1])
    hand("b", [1, 3], [1, 1])   # a shared prefix block at its generation: nothing stale
    assert runner._stale == set() and step("a", "b") is None
    hand("c", [2], [2])         # block 2 handed anew while a holds it
    assert runner._stale == {"a"} and step("b", "c") is None
    assert step("b", "a") == ("KV sanitizer, rank 0 (tp 0, pp 0), step 7: request a reads block 2 in layer 0's "
                              "attention, handed to it at generation 1, but the block has since been handed out at "
                              "generation 2: it was freed and reused while the request held it (a use after free)")
    hand("d", [2], [1])         # handed at an older generation than block 2's newest
    assert runner._stale == {"a", "d"} and "request d reads block 2" in step("d")


@pytest.mark.parametrize("sanitizer", [True, False])
def test_the_scheduler_clock_times_the_sanitizers_check(sanitizer):
    """LLMEngine.clock_scheduler (what bench debug-overhead reads): the block manager's checks, inside the scheduler's
    calls; none without the sanitizer."""
    from devharness import LLM
    with LLM("tiny-llama", num_kv_blocks=32, threads_per_worker=1, kv_sanitizer=sanitizer) as llm:
        clock = llm.engine.clock_scheduler()
        llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(max_tokens=4, ignore_eos=True))
        assert clock.scheduler_s > 0
        assert (0 < clock.kv_check_s < clock.scheduler_s) if sanitizer else clock.kv_check_s == 0
        clock.reset()
        assert clock.kv_check_s == clock.scheduler_s == 0
