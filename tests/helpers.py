"""Shared test inputs."""
import random


def mixed_prompts(n: int, seed: int = 0, lengths=(1, 3, 5, 8, 15, 16, 17, 31, 33, 47, 64, 70, 100)) -> list[list[int]]:
    """`n` token-id prompts of mixed lengths (crossing block boundaries), byte ids only."""
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def as_inputs(prompts):
    return [{"prompt_token_ids": p} for p in prompts]
