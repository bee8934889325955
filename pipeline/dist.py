"""Rank discovery shared by every stage: torchrun (RANK/WORLD_SIZE) or Slurm (SLURM_PROCID/SLURM_NTASKS)."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_info() -> RankInfo:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return RankInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return RankInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)))
    return RankInfo(0, 1, 0)


def shard_for_rank(n_items: int, info: RankInfo) -> range:
    """Item indices (e.g. whole batches) of this rank: round-robin, so ranks get near-equal work and
    the assignment depends only on (n_items, rank, world_size)."""
    return range(info.rank, n_items, info.world_size)


def rank_target_config(target_cfg, info: RankInfo):
    """The target config of this rank: with several ranks on CUDA, rank i of a node takes cuda:<local rank>
    (`auto`/`cuda` would put them all on cuda:0). An explicit device (cpu, cuda:N) is kept as given."""
    import dataclasses

    import torch

    if info.world_size > 1 and target_cfg.device in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank)
        return dataclasses.replace(target_cfg, device=f"cuda:{info.local_rank}")
    return target_cfg
