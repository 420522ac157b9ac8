"""Token sampling: greedy, temperature, top-k, top-p, one reproducible random stream per request.

Each sampled token draws its noise from a generator seeded by (request seed, output index), so
a seeded request gives the same tokens whatever it is batched with, and after preemption too.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Callable, NamedTuple

import torch

_MASK64 = (1 << 63) - 1


def token_seed(request_seed: int, output_index: int) -> int:
    return (request_seed * 6364136223846793005 + (output_index + 1) * 1442695040888963407) & _MASK64


@dataclass
class SamplingBatch:
    """Per-row parameters of the rows to sample (one row per request that completed its chunk)."""

    temperatures: list[float]
    top_ks: list[int | None]
    top_ps: list[float]
    seeds: list[int]          # token_seed(...) for each row
    num_logprobs: list[int | None]


def sample(logits: torch.Tensor, batch: SamplingBatch, argmax: Callable[[torch.Tensor], torch.Tensor],
           raw_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [N, V] -> (token ids [N], log-probabilities [N, V] if any row asked for logprobs), on logits' device.
    `argmax` is the engine's argmax op (each row's first largest value). Logprobs are the model's own, as vLLM
    returns them: of `raw_logits` where `logits` were processed (penalties, biases; process_logits)."""
    logits = logits.float()
    n, vocab = logits.shape
    device = logits.device
    tokens = argmax(logits)
    logprobs = torch.log_softmax((raw_logits if raw_logits is not None else logits).float(), dim=-1) \
        if any(k is not None for k in batch.num_logprobs) else None
    rows = [i for i in range(n) if batch.temperatures[i] != 0.0]
    if not rows:   # all greedy
        return tokens, logprobs
    index = torch.tensor(rows, device=device)
    sub = logits[index] / torch.tensor([batch.temperatures[i] for i in rows], device=device).unsqueeze(1)
    top_ks = [min(batch.top_ks[i] or vocab, vocab) for i in rows]   # a top_k past the vocabulary keeps it all
    top_ps = [batch.top_ps[i] for i in rows]
    if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = sub.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device).unsqueeze(0)
        drop = rank >= torch.tensor(top_ks, device=device).unsqueeze(1)
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop |= (probs.cumsum(dim=-1) - probs) > torch.tensor(top_ps, device=device).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        sub = torch.empty_like(sub).scatter_(1, order, sorted_logits)
    probs = sub.softmax(dim=-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, noise from the row's own generator. The
    # generator is the device's own (a GPU draws on the GPU), so a seed gives the same tokens on one device
    # type whatever the batch; a CPU and a GPU draw different streams.
    noise = torch.empty_like(probs)
    gen = _generator(device)
    for j, i in enumerate(rows):
        gen.manual_seed(batch.seeds[i])
        noise[j].exponential_(generator=gen)
    tokens[index] = argmax(probs / noise)
    return tokens, logprobs


def process_logits(row: torch.Tensor, token_ids: list[int], num_output: int, params,
                   eos_token_ids: list[int]) -> None:
    """vLLM's logits processors but the bias (add_logit_bias, over the batch), in place on one request's row of float
    logits: the repetition penalty over the tokens of its prompt and output (a positive logit divided by it, a
    negative one multiplied) and, before `min_tokens` output tokens, EOS (unless ignored) and the stop token ids
    masked. The bias comes after the penalty; a masked token stays -inf whatever its bias."""
    device = row.device
    if params.repetition_penalty != 1.0 and token_ids:
        seen = torch.tensor(sorted(set(token_ids)), device=device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if num_output < params.min_tokens:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        if banned:
            row[torch.tensor(sorted(banned), device=device)] = float("-inf")


class LogitBias(NamedTuple):
    """One request's `logit_bias` as tensors on the logits' device, made once for the request's life."""

    ids: torch.Tensor      # [K] token ids
    values: torch.Tensor   # [K] float32

    @classmethod
    def of(cls, logit_bias: dict[int, float], device: torch.device) -> "LogitBias":
        return cls(torch.tensor(list(logit_bias), dtype=torch.long, device=device),
                   torch.tensor(list(logit_bias.values()), dtype=torch.float32, device=device))


def add_logit_bias(logits: torch.Tensor, rows: list[int], biases: list[LogitBias]) -> None:
    """Each row's bias added to its float logits [N, V] in place, every row in one index_put_ (a row and a Python
    loop each would cost the step every other request waits on as much again as the rows are many)."""
    if not rows:
        return
    device = logits.device
    counts = [len(b.ids) for b in biases]
    # output_size: a device need not be asked how long the result is
    row_ids = torch.repeat_interleave(torch.tensor(rows, device=device), torch.tensor(counts, device=device),
                                      output_size=sum(counts))
    logits.index_put_((row_ids, torch.cat([b.ids for b in biases])),
                      torch.cat([b.values for b in biases]).to(logits.dtype), accumulate=True)


_generators: dict[torch.device, torch.Generator] = {}


def _generator(device: torch.device) -> torch.Generator:
    """One generator per device, reseeded for every row it draws."""
    gen = _generators.get(device)
    if gen is None:
        gen = _generators[device] = torch.Generator(device=device)
    return gen
