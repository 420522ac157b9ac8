"""`devharness check` on a model of a short context: the probe (its prompt and decode steps) and the batch check's
step budget are fitted to the positions a request may reach, and the verdict says what was changed. Only what the
user did not give is changed; a --prompt or --decode-steps of the user's that cannot fit is a ValueError naming
the flag (the CLI's one line, exit 2)."""
from __future__ import annotations

DEFAULT_PROMPT = "The capital of France is"
DEFAULT_DECODE_STEPS = 4
# The batch check's plan at its smallest: a step budget of 2 blocks, a prompt of 1.5 budgets chunked beside the
# probe and its decodes (a block): 4 blocks, 64 positions at the default block size.
PLAN_BLOCKS = 4


def context_of(cfg, arch, kv_blocks: bool = True) -> tuple[int, str]:
    """The positions a request may reach on an engine of `cfg` (its max_model_len, or the model's positions; and
    the KV cache's where --num-kv-blocks sets it and `kv_blocks`), and what sets them, as the verdict says it."""
    n, why = arch.max_position_embeddings, f"the model's {arch.max_position_embeddings} positions"
    if cfg.model.max_model_len is not None:
        n, why = cfg.model.max_model_len, f"--max-model-len {cfg.model.max_model_len}"
    blocks, bs = cfg.scheduler.num_kv_blocks, cfg.scheduler.block_size
    if kv_blocks and blocks is not None and blocks * bs < n:
        n, why = blocks * bs, f"--num-kv-blocks {blocks} ({blocks * bs} positions)"
    return n, why


def fit_probe(ids: list[int], decode_steps: int, context: int, why: str, prompt_given: bool,
              steps_given: bool) -> tuple[list[int], int, list[str]]:
    """The probe's prompt ids and decode steps within `context` positions (a probe takes len(ids) + decode_steps
    + 1: the last decode step samples one token more), and what was changed to fit. The default prompt is cut to
    its first tokens, then the default decode steps are lowered."""
    notes = []
    keep = max(1, context - 1 - decode_steps)   # of the prompt's tokens
    if len(ids) > keep and not prompt_given:
        ids = ids[:keep]
        notes.append(f"probe shortened to {keep} token{'s' * (keep > 1)} to fit {why}")
    if len(ids) + decode_steps + 1 > context and len(ids) < context and not steps_given:
        decode_steps = context - 1 - len(ids)
        notes.append(f"decode steps cut to {decode_steps} to fit {why}")
    if len(ids) + decode_steps + 1 <= context:
        return ids, decode_steps, notes
    if prompt_given and len(ids) >= context:
        raise ValueError(f"--prompt has {len(ids)} tokens: at most {context - 1} fit in {why} (one kept for the "
                         f"output): give a shorter --prompt")
    if prompt_given:
        raise ValueError(f"--decode-steps {decode_steps} after --prompt's {len(ids)} tokens takes "
                         f"{len(ids) + decode_steps + 1} positions, more than {why}: give --decode-steps "
                         f"{context - 1 - len(ids)} or fewer (or a shorter --prompt)")
    raise ValueError(f"--decode-steps {decode_steps}: at most {max(0, context - 2)} fit in {why} (after a prompt "
                     f"of one token): give --decode-steps {max(0, context - 2)} or fewer")


def batch_budget(block_size: int, max_num_batched_tokens: int, context: int | None = None) -> int:
    """The batch check's step budget: the engine's, at most 16 blocks (a call of more rows than a kernel choice's
    `custom<=N` may run another kernel), at most what lets its chunked prompt (1.5 budgets) and that prompt's
    decodes (a block) fit in `context`; at least 2 blocks, in whole pairs of blocks."""
    bs = block_size
    most = min(max_num_batched_tokens, 16 * bs)
    if context is not None:
        most = min(most, (context - bs) * 2 // 3)
    return max(2 * bs, most // (2 * bs) * 2 * bs)


def check_plan_fits(context: int, why: str, block_size: int) -> None:
    """The batch check's smallest plan needs requests of PLAN_BLOCKS blocks; else a ValueError naming the flag."""
    if context < PLAN_BLOCKS * block_size:
        fits = 1 << max(0, (context // PLAN_BLOCKS).bit_length() - 1)   # a power of two, as block sizes go
        longer = f" (or --max-model-len {PLAN_BLOCKS * block_size})" if why.startswith("--max-model-len") else ""
        raise ValueError(f"--block-size {block_size}: the batch check needs requests of {PLAN_BLOCKS} blocks "
                         f"({PLAN_BLOCKS * block_size} positions), more than {why}: give --block-size {fits} or "
                         f"less{longer}")
