"""The torch device a rank computes on, and whether this machine can give its workers one.

Everything a rank makes per step (inputs, attention masks, the sampler's tensors and generators, the KV
cache, received activations) is built on this device; only sampled tokens and logprobs leave it, moved to
the host once per step.
"""
from __future__ import annotations

import torch


def check_available(device: str, num_local_ranks: int) -> None:
    """Before any worker starts: ValueError when this machine cannot give `num_local_ranks` workers `device`."""
    if not device.startswith("cuda"):
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"device {device!r}: torch {torch.__version__} sees no CUDA device; use device 'cpu', "
                         "or on a GPU machine install a CUDA build of torch (make install CONSTRAINTS=)")
    if ":" in device and int(device.split(":")[1]) >= count:
        raise ValueError(f"device {device!r}: torch sees {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    if num_local_ranks > count:
        raise ValueError(f"device {device!r}: {num_local_ranks} workers on this machine need a GPU each, but torch "
                         f"sees {count}; lower tp x pp or use the ray executor across nodes")


def rank_device(device: str, rank: int) -> torch.device:
    """Rank `rank`'s device; a GPU is also made the process's current device, which nccl and every kernel
    launched without an explicit device use."""
    if not device.startswith("cuda"):
        return torch.device(device)
    if not torch.cuda.is_available():
        raise ValueError(f"rank {rank}: device {device!r}, but torch {torch.__version__} sees no CUDA device here")
    # Under Ray a worker sees only the GPU it was given; under mp every rank sees all of them.
    dev = torch.device(device) if ":" in device else torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev
