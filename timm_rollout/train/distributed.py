"""Distributed data parallel under ``torchrun``: the process's rank, world size and device, and the one reduction.

A single process is rank 0 of a world of 1, and every helper here is then the identity.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..device import resolve_device
from ..errors import UserError


@dataclass
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str) -> Dist:
    """Single process, or DDP under ``torchrun`` (NCCL on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = resolve_device(device)
    if world == 1:
        return Dist(0, 1, dev)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        if local >= torch.cuda.device_count():
            raise UserError(f"local rank {local} has no GPU ({torch.cuda.device_count()} visible); start at most "
                            "that many processes per node, or pass --device cpu")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        if dev.type == "cuda":
            dist.init_process_group("nccl", device_id=dev)
        else:
            dist.init_process_group("gloo")
    return Dist(rank, world, dev)


def reduce_sum(values: torch.Tensor, d: Dist) -> torch.Tensor:
    """Sum across ranks (identity in a single process)."""
    if d.world > 1:
        values = values.clone()
        dist.all_reduce(values)
    return values
