"""`devharness check --prefix-cache`: the same prompt computed cold (no prefix cache) and with its first blocks
from the prefix cache, on one layout; every layer's sites and the logits compared bit for bit, rank against rank.

The cached run, on an engine with a KV cache of just enough blocks (the plan below):
1. a request of the prompt's full blocks (one token sampled) fills them; their hashes enter the prefix cache;
2. an unrelated request takes every free block and one more: the least recently freed, the last of those
   blocks, whose cached prefix is evicted (so a block freed and re-filled is part of every check);
3. the prompt: its first blocks but the last full one come from the cache, the rest is computed (the suffix).
Cold, on a fresh engine with prefix caching off, the prompt is computed whole. The suffix's rows of the prefill
and every decode step are compared with the cold run's same rows, and each step's top log probabilities.

Bit for bit holds: attention over a prefix read from the cache gives, on every kernel of this project, the bits
the same rows get in one whole prefill (the suffix's queries meet the same keys and values; each row's sums run
over the same positions in the same order). The logits are compared as the 20 top log probabilities of each
sampled token (SamplingParams.logprobs), ids and values. A planted kv-bitflip (a cached block's key changed
after it was written) parts first at that layer's attention output; a kv-stale-hit (a re-filled block still
found under its old prefix) at layer 0, with one block more taken from the cache than planned.
"""
from __future__ import annotations

import numpy as np

from devharness.monitor.check import (SITES, Captured, CheckReport, _captured, compare_keys, comparable_steps,
                                      default_tolerance, rel_diff, sites_of, triage)
from devharness.protocol.messages import ArmCapture

LOGITS = "logits (top log probabilities)"
MIN_FULL_BLOCKS = 2   # one from the cache, one evicted before the prompt comes


class PrefixReport(CheckReport):
    def _verdict(self) -> str:
        hit, planned = self.about["hit_blocks"], self.about["planned_hit_blocks"]
        took = f"{hit} of its {self.about['full_blocks']} full block(s) from the prefix cache"
        if hit != planned:
            took += f" (planned: {planned}; {'a block found that was evicted' if hit > planned else 'a miss'})"
        first = self.first_divergent
        if first is not None or self.reference_tokens != self.target_tokens:
            return f"{super()._verdict()}; the cached run took {took}"
        if not hit:
            return f"check: the prompt took no block from the prefix cache: nothing was checked ({took})"
        return (f"check: the prompt with {took} matches it computed cold at every layer, site and logit, bit for "
                f"bit (tp={self.tp_size} pp={self.pp_size}, {len(self.sites)} compared)")

    @property
    def ok(self) -> bool:
        return super().ok and self.about["hit_blocks"] == self.about["planned_hit_blocks"] > 0


def prefix_probe(ids: list[int], block_size: int, context: int, why: str, prompt_given: bool) -> tuple[list[int], list[str]]:
    """The prompt's ids, at least MIN_FULL_BLOCKS full blocks and a token: the default prompt repeated to two and a
    half blocks (within `context`); a given prompt that is shorter is a ValueError."""
    need = MIN_FULL_BLOCKS * block_size + 1
    if len(ids) >= need:
        return ids, []
    if prompt_given:
        raise ValueError(f"--prompt has {len(ids)} tokens: --prefix-cache needs at least {need} ({MIN_FULL_BLOCKS} "
                         f"full blocks of {block_size} and a token): give a longer --prompt")
    n = need + block_size // 2
    if n > context - 2:
        raise ValueError(f"--prefix-cache needs a prompt of {need} tokens and more positions than {why}")
    return [ids[i % len(ids)] for i in range(n)], [f"probe repeated to {n} tokens ({MIN_FULL_BLOCKS} full blocks "
                                                   f"and a half)"]


def prefix_plan(prompt_len: int, decode_steps: int, block_size: int, vocab_size: int) -> dict:
    """The cached run's engine and requests (the module docstring): KV blocks, the filler's prompt and the
    blocks the prompt should take from the cache."""
    bs = block_size
    full = (prompt_len - 1) // bs   # the last token is always computed
    blocks = -(-(prompt_len + decode_steps) // bs) + 1
    filler = [(3 + 11 * i) % vocab_size for i in range((blocks - full) * bs + 1)]   # blocks - full + 1 blocks
    return {"num_kv_blocks": blocks, "full_blocks": full, "planned_hit_blocks": full - 1, "filler": filler}


def _params(n: int):
    from devharness import SamplingParams
    from devharness.config import MAX_LOGPROBS
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=MAX_LOGPROBS)


def _capture(llm, ids: list[int], decode_steps: int) -> Captured:
    """The prompt's prefill and decodes on `llm`, every site of every rank, and each step's top logprobs (as
    key (step, None, "logits", None) on rank 0)."""
    out, kept = _captured(llm, ArmCapture(), lambda: llm.generate([{"prompt_token_ids": ids}],
                                                                   _params(decode_steps + 1)))
    tensors, logits = sites_of(kept)
    comp = out[0].outputs[0]
    for step, lp in enumerate(comp.logprobs or []):
        tensors[(step, None, "logits", None)] = {0: np.array([lp.top_token_ids, lp.top_logprobs], dtype=np.float64)}
    return Captured(tensors, list(comp.token_ids), logits=logits)


def compare_prefix(cold: Captured, cached: Captured, tp_size: int, pp_size: int, about: dict,
                   dtype: str = "float32") -> PrefixReport:
    """The cached run's rows against the cold run's same rows (its prefill's last rows), rank against rank."""
    steps = comparable_steps(cold.tokens, cached.tokens)

    def rows(key, rank, t):   # of the cold prefill, the last rows: those the cached prefill computed
        mine = cached.tensors.get(key, {}).get(rank)
        return t[t.shape[0] - mine.shape[0]:] if key[0] == 0 and key[2] != "logits" and mine is not None else t
    ref = {k: {r: rows(k, r, t) for r, t in by_rank.items()} for k, by_rank in cold.tensors.items()}
    order = {site: i for i, site in enumerate([*SITES, "logits"])}
    keys = sorted((k for k in cached.tensors if k[3] is None and k[0] < steps),
                  key=lambda k: (k[0], 1 << 30 if k[1] is None else k[1], order[k[2]]))
    if missing := sorted({k for k in ref if k[3] is None and k[0] < steps} - set(keys), key=str):
        raise RuntimeError(f"the cached run captured no activations for (step, layer, site) {missing[:4]}")

    def partials(key):   # each rank's own partial sum against the cold run's (tp > 1)
        step, layer, site, _ = key
        out = {}
        for shard in range(tp_size if tp_size > 1 else 0):
            for rank, t in cached.tensors.get((step, layer, site, shard), {}).items():
                out[rank] = rel_diff(ref.get((step, layer, site, shard), {}).get(rank), t)
        return out

    sites = compare_keys(keys, ref, cached.tensors, 0.0, tp_size,
                         lambda k: {"step": k[0], "layer": k[1], "site": SITES.get(k[2], LOGITS)},
                         partials=partials)
    return PrefixReport(sites, cold.tokens, cached.tokens, 0.0, tp_size, pp_size, "prefix",
                        "the cached prefix", "cold", about, triage=triage(cold, cached, default_tolerance(dtype)))


def fit_prefix(model: str, prompt, decode_steps: int, prompt_given: bool, steps_given: bool,
               **kw) -> tuple[dict, int, list[str]]:
    """The probe as token ids, long enough for the plan (prefix_probe) and fitted to the model's context
    (check_fit.fit_probe), its decode steps, and what was changed."""
    from devharness.engine.args import EngineArgs
    from devharness.model.loader import resolve_model
    from devharness.monitor.check import prompt_ids
    from devharness.monitor.check_fit import context_of, fit_probe
    cfg = EngineArgs.from_kwargs(model=model, **kw).create_engine_config()   # a bad value, before any engine
    context, why = context_of(cfg, resolve_model(model).arch, kv_blocks=False)   # the plan sizes the KV cache
    bs = cfg.scheduler.block_size
    ids, notes = prefix_probe(prompt_ids(model, prompt), bs, context, why, prompt_given)
    ids, decode_steps, more = fit_probe(ids, decode_steps, context, why, prompt_given, steps_given)
    if len(ids) < MIN_FULL_BLOCKS * bs + 1:
        raise ValueError(f"--prefix-cache needs a prompt of {MIN_FULL_BLOCKS * bs + 1} tokens and its decode steps "
                         f"in {why}")
    return {"prompt_token_ids": ids}, decode_steps, notes + more


capture_cold = _capture


def capture_cached(llm, ids: list[int], decode_steps: int, plan: dict) -> tuple[Captured, dict]:
    """The plan's cached run on `llm` (an engine with prefix caching and the plan's KV blocks, none held): the
    prefix cache emptied, the prompt's full blocks filled, one evicted, then the prompt captured; and what the
    report says of it (the blocks it took from the cache)."""
    bs = llm.engine.config.scheduler.block_size
    if not llm.engine.reset_prefix_cache():
        raise RuntimeError("the engine holds KV blocks: the prefix cache could not be emptied")
    llm.generate([{"prompt_token_ids": ids[:plan["full_blocks"] * bs]}], _params(1))
    llm.generate([{"prompt_token_ids": plan["filler"]}], _params(1))
    before = llm.engine.stats()["prefix_cache_hit_tokens"]
    cached = _capture(llm, ids, decode_steps)
    return cached, {"prompt_tokens": len(ids), "full_blocks": plan["full_blocks"],
                    "hit_blocks": (llm.engine.stats()["prefix_cache_hit_tokens"] - before) // bs,
                    "planned_hit_blocks": plan["planned_hit_blocks"], "num_kv_blocks": plan["num_kv_blocks"]}


def run_prefix_check(model: str, prompt, tolerance: float, decode_steps: int, **kwargs) -> PrefixReport:
    """`prompt` (token ids, fitted by prefix_probe) cold and with its prefix cached, on the layout of kwargs; a
    planted fault (kwargs' inject) goes to the cached run only: the cold run is the reference."""
    from devharness import LLM
    from devharness.engine.args import EngineArgs
    from devharness.model.loader import resolve_model
    ids = list(prompt["prompt_token_ids"])
    cfg = EngineArgs.from_kwargs(model=model, **kwargs).create_engine_config()
    plan = prefix_plan(len(ids), decode_steps, cfg.scheduler.block_size, resolve_model(model).arch.vocab_size)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("enable_prefix_caching", "num_kv_blocks")}
    cold_kwargs = {k: v for k, v in kwargs.items() if k != "inject"}
    with LLM(model, enable_prefix_caching=False, **cold_kwargs) as llm:
        cold = capture_cold(llm, ids, decode_steps)
    with LLM(model, enable_prefix_caching=True, num_kv_blocks=plan["num_kv_blocks"], **kwargs) as llm:
        cached, about = capture_cached(llm, ids, decode_steps, plan)
    tp, pp = kwargs.get("tensor_parallel_size", 1), kwargs.get("pipeline_parallel_size", 1)
    return compare_prefix(cold, cached, tp, pp, about, cfg.model.dtype)
