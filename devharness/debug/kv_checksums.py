"""KV checksums, the KV sanitizer's check of what the cache holds (its bookkeeping: engine/kv_cache.py).

With the sanitizer on, each rank keeps, for every full block of its KV cache, a checksum of the block's keys and
values per layer (taken after the step that fills it, the step after which the driver may publish its hash in the
prefix cache) and the chained hash of the tokens it holds. After each step's forward it checks:

- every block a prefix hit handed over in this step: it still holds the tokens the new request's prefix names (else
  a stale hit: the block was re-filled with other tokens while the prefix cache still named it), and its checksums
  still match, at every layer;
- every READ_EVERY steps, up to READS_PER_CHECK of the full blocks the step's attention read, in turn (each running
  request one block a turn, its blocks in rotation), so a block a request keeps reading is checked now and then,
  at a cost of one pass over a few blocks every few steps.

A block handed out for new tokens loses its checksum until it fills again. A mismatch is a KvAlarm naming the block,
the first layer that differs, this rank, the request that wrote the block, the ones that read it and the step; it goes
back with the step's output and the driver ends those requests. The rank itself changes nothing: its forward ran as
its peers' did (one rank skipping work would leave its peers waiting in a collective).

The checksum: the block's bytes as int32 words, each times an odd weight (2 i + 1), summed, all modulo 2**32. A
flipped bit changes its word by a power of two below 2**32, times an odd weight: never 0 modulo 2**32, so a single
bit flip is always caught; the position weights catch words moved within the block.
"""
from __future__ import annotations

import logging

import torch

from devharness.protocol.messages import KvAlarm

logger = logging.getLogger(__name__)

READ_EVERY = 16           # steps between two checks of blocks being read (one pass over the cache for several)
READS_PER_CHECK = 16      # full blocks checked then among those the step's attention read
CHUNK_WORDS = 1 << 22     # int32 words gathered at once (16 MiB), so a long prefill is checksummed in parts


def chain_hashes(hashes: list[int], token_ids: list[int], num_blocks: int, block_size: int) -> list[int]:
    """Extend `hashes` to the chained hashes of the first `num_blocks` blocks of `token_ids`, as the driver's prefix
    cache names them (engine/kv_cache.py: a tuple's hash of ints is the same in every process)."""
    while len(hashes) < num_blocks:
        i = len(hashes)
        hashes.append(hash((hashes[-1] if hashes else None, tuple(token_ids[i * block_size:(i + 1) * block_size]))))
    return hashes


class KvChecksums:
    """One rank's checksums of its KV cache blocks: `after_step` takes and checks them; `forget` drops a request."""

    def __init__(self, kv: torch.Tensor, first_layer: int, block_size: int, who: str, rank: int):
        """`kv`: the rank's whole KV cache, [layer, key|value, block, ...] (each layer's caches are views of it);
        `first_layer`: the model layer of its layer 0; `who`: "rank 1 (tp 1, pp 0)"."""
        self.kv = kv
        self.num_layers = kv.shape[0]
        self.first_layer = first_layer
        self.block_size = block_size
        self.who, self.rank = who, rank
        words = kv[0, 0, 0].numel() * kv.element_size() // 4
        self.weights = torch.arange(1, 2 * words, 2, dtype=torch.int32, device=kv.device)
        # [block, layer, key|value] checksums, valid where `meta` holds a token hash.
        self.sums = torch.zeros((kv.shape[2], self.num_layers, 2), dtype=torch.int32, device=kv.device)
        self.meta: dict[int, tuple[int | None, str, int]] = {}   # block -> (token hash | None, writer, step)
        self.hashes: dict[str, list[int]] = {}   # request -> chained hashes of its full blocks
        self.turn: dict[str, int] = {}           # request -> how many of its reads were checked
        self.rotation = 0
        self.taken = self.verified = 0           # blocks checksummed, blocks verified (for tests and the bench)

    def forget(self, rid: str) -> None:
        self.hashes.pop(rid, None)
        self.turn.pop(rid, None)

    def _compute(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks), layers, 2] checksums of what the blocks hold now, in int32 arithmetic that wraps (modulo
        2**32, where an odd weight keeps a flipped bit's change nonzero): one gather of every layer's copy."""
        step = max(1, CHUNK_WORDS // (2 * self.num_layers * self.weights.numel()))
        parts = []
        for i in range(0, len(blocks), step):
            part = blocks[i:i + step]
            idx = torch.tensor(part, dtype=torch.long, device=self.kv.device)
            words = self.kv.index_select(2, idx).view(self.num_layers, 2, len(part), -1).view(torch.int32)
            parts.append(words.mul_(self.weights).sum(-1, dtype=torch.int32).permute(2, 0, 1))   # a copy: in place
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def after_step(self, step: int, new_requests, cached_requests, scheduled: dict[str, int], states: dict,
                   failed) -> list[KvAlarm]:
        """Take and check the checksums of step `step`, after its forward. `states`: the runner's request states
        (token_ids, block_ids, num_computed_tokens as at the step's start); `failed`: requests that ran no rows."""
        bs = self.block_size
        alarms: list[KvAlarm] = []
        # Blocks handed out for new tokens hold nothing checksummed until they fill.
        for r in new_requests:
            self.hashes.pop(r.req_id, None)
            for b in r.block_ids[r.num_computed_tokens // bs:]:
                self.meta[b] = (None, r.req_id, step)
        for c in cached_requests:
            if c.new_block_ids:   # most decode steps hand out none
                for b in c.new_block_ids:
                    self.meta[b] = (None, c.req_id, step)
        check: dict[int, None] = {}   # the blocks to check, in order
        hits: set[int] = set()
        if new_requests:
            alarms += self._check_hits(step, new_requests, states, failed, check, hits)
        # The blocks this step filled; every READ_EVERY steps, a few full blocks being read, in turn.
        fills: list[tuple[int, str, int]] = []
        for rid, n in scheduled.items():   # a request fills a block where its rows cross a block's end
            st = states.get(rid)
            if st is None or rid in failed:
                continue
            start = st.num_computed_tokens
            if start % bs + n >= bs:   # a decode: every bs steps
                fills += [(st.block_ids[i], rid, i) for i in range(start // bs, (start + n) // bs)]
        if step % READ_EVERY == 0:
            self._pick_reads(check, scheduled, states, failed)
        if not check and not fills:
            return alarms
        # One pass over the cache for both: the blocks checked, then the blocks filled (never the same: a block
        # fills in the step its request writes its last slot, and is read only in later steps).
        checked = list(check)
        filled = [b for b, _, _ in fills]
        now = self._compute(checked + filled)
        if checked:
            alarms += self._verify(step, checked, now[:len(checked)], hits, states)
        if filled:
            self.sums[torch.tensor(filled, dtype=torch.long, device=self.sums.device)] = now[len(checked):]
            self.taken += len(filled)
            for b, rid, i in fills:
                hashes = chain_hashes(self.hashes.setdefault(rid, []), states[rid].token_ids, i + 1, bs)
                self.meta[b] = (hashes[i], rid, step)
        return alarms

    def _check_hits(self, step: int, new_requests, states: dict, failed, check: dict, hits: set) -> list[KvAlarm]:
        """Each block a prefix hit hands over must hold the tokens the new request's prefix names (else: an alarm, a
        stale hit); those that do are to be checked against their checksums (added to `check` and `hits`)."""
        bs, alarms = self.block_size, []
        for r in new_requests:
            st = states.get(r.req_id)
            n = r.num_computed_tokens // bs
            if not n or st is None or r.req_id in failed:
                continue
            hashes = chain_hashes(self.hashes.setdefault(r.req_id, []), st.token_ids, n, bs)
            for i, b in enumerate(r.block_ids[:n]):
                h, writer, written = self.meta.get(b, (None, None, None))
                if h == hashes[i]:
                    check[b] = None
                    hits.add(b)
                    continue
                if h is not None:
                    now = f"holds the keys and values of other tokens, written by request {writer} at step {written}"
                elif writer is not None:
                    now = (f"was handed to request {writer} for new tokens at step {written} and has not been "
                           f"filled since")
                else:
                    now = "holds no keys and values checksummed on this rank"
                layers = f"{self.first_layer}-{self.first_layer + self.num_layers - 1}"
                alarms.append(self._alarm(step, b, self.first_layer, [r.req_id], writer, written,
                                          f"block {b}, layers {layers}: handed to request {r.req_id} from the prefix "
                                          f"cache as its block {i}, but it {now} (a stale prefix-cache hit)"))
        return alarms

    def _pick_reads(self, check: dict[int, None], scheduled: dict[str, int], states: dict, failed) -> None:
        """Up to READS_PER_CHECK full blocks the step read and that hold a checksum: each running request's next one
        in its rotation, the requests themselves in turn from check to check."""
        bs = self.block_size
        running = [rid for rid in scheduled if rid not in failed and rid in states]
        budget = READS_PER_CHECK
        for j in range(len(running)):
            rid = running[(self.rotation + j) % len(running)]
            st = states[rid]
            read = st.num_computed_tokens // bs
            if not read:
                continue
            turn = self.turn.get(rid, 0)
            self.turn[rid] = turn + 1
            b = st.block_ids[turn % read]
            if b not in check and self.meta.get(b, (None,))[0] is not None:
                check[b] = None
                budget -= 1
                if not budget:
                    break
        self.rotation += 1

    def _verify(self, step: int, blocks: list[int], now: torch.Tensor, hits: set, states: dict) -> list[KvAlarm]:
        self.verified += len(blocks)
        was = self.sums[torch.tensor(blocks, dtype=torch.long, device=self.sums.device)]
        if torch.equal(now, was):   # one op (and one sync on a GPU) where all match
            return []
        bad = (now != was)
        alarms = []
        for row in bad.any(-1).any(-1).nonzero().flatten().tolist():
            b = blocks[row]
            i = int(bad[row].any(-1).nonzero()[0])
            what = " and ".join(name for name, differs in zip(("keys", "values"), bad[row, i].tolist()) if differs)
            _, writer, written = self.meta.pop(b)   # named once: the driver drops it from the prefix cache
            # Every request that holds the block reads what changed, those not scheduled now included.
            readers = [rid for rid, st in states.items() if b in st.block_ids]
            how = "handed over by a prefix hit" if b in hits else "read by attention"
            alarms.append(self._alarm(step, b, self.first_layer + i, readers, writer, written,
                                      f"block {b}, layer {self.first_layer + i}: its {what} differ from their "
                                      f"checksum taken when request {writer} wrote it at step {written} ({how}, "
                                      f"held by request(s) {', '.join(readers) or 'none'})"))
        return alarms

    def _alarm(self, step, block, layer, readers, writer, written, what) -> KvAlarm:
        message = f"KV checksum, {self.who}, step {step}: {what}"
        logger.error("%s", message)
        return KvAlarm(self.rank, step, block, layer, readers, writer, written, message)
