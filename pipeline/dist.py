"""Rank discovery shared by every stage: torchrun (RANK/WORLD_SIZE) or Slurm (SLURM_PROCID/SLURM_NTASKS), and the
target's parallel layout (`TargetLayout`: which ranks hold one tensor-parallel target together)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)


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


# ---------------------------------------------------------------------------------------------------------
# the target's layout: groups of `tensor_parallel` consecutive ranks, each holding ONE target sharded by
# transformers' own tensor parallelism; the groups are the data-parallel replicas.


class LayoutError(ValueError):
    """A tensor-parallel layout the job cannot have, in one line."""


@dataclass(frozen=True)
class TargetLayout:
    """Where this rank stands: `tp` ranks (rank // tp = its group) run one target in lockstep on the same inputs
    and get the same (replicated) outputs; the `data_world` groups split the work as `data_world` single ranks
    would (`data` is the RankInfo a stage's batch split uses). tp=1 is one replica per rank, as without it."""

    rank: int
    world_size: int
    local_rank: int
    tp: int = 1

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def data_rank(self) -> int:
        return self.rank // self.tp

    @property
    def data_world(self) -> int:
        return self.world_size // self.tp

    @property
    def data(self) -> RankInfo:
        """The group as one rank of `data_world`: the batch split of dump, online training and validation."""
        return RankInfo(self.data_rank, self.data_world, self.local_rank)

    @property
    def is_writer(self) -> bool:
        """The group's first rank: the one that writes what the group computed (shards, progress)."""
        return self.tp_rank == 0

    @property
    def sharded(self) -> bool:
        return self.tp > 1

    def group(self):
        """The torch.distributed process group of this rank's TP group (tp > 1 only)."""
        return tp_mesh(self)["tp"].get_group()

    def agree(self, value):
        """`value` as the group's first rank has it, on every rank of the group (any picklable object): decisions
        that read the clock or the file system, which the ranks of a group must take identically."""
        if not self.sharded:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=self.rank - self.tp_rank, group=self.group())
        return box[0]

    def as_dict(self) -> dict:
        return {"tensor_parallel": self.tp, "data_parallel": self.data_world, "world_size": self.world_size}


def target_layout(tensor_parallel: int = 1, info: Optional[RankInfo] = None) -> TargetLayout:
    """This rank's layout for `target.tensor_parallel`; refuses a world size it does not divide."""
    info = info or rank_info()
    tp = int(tensor_parallel)
    if tp < 1:
        raise LayoutError(f"target.tensor_parallel={tp}: must be >= 1")
    if info.world_size % tp:
        raise LayoutError(f"target.tensor_parallel={tp} does not divide the world size {info.world_size}: every "
                          f"group of {tp} consecutive ranks holds one target; run a multiple of {tp} processes")
    return TargetLayout(info.rank, info.world_size, info.local_rank, tp)


def export_slurm_ranks() -> None:
    """Under `srun` without torchrun only SLURM_* is set; torch.distributed reads RANK/WORLD_SIZE/MASTER_ADDR."""
    info = rank_info()
    if info.world_size > 1 and "RANK" not in os.environ:
        os.environ.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank))
        os.environ.setdefault("MASTER_PORT", "29500")
        if "MASTER_ADDR" not in os.environ:
            raise RuntimeError("multi-task Slurm launch: export MASTER_ADDR (the first node's hostname)")


_MESHES: dict = {}


def tp_mesh(layout: TargetLayout):
    """The 2-D (dp, tp) DeviceMesh of the job (created once; a collective: every rank of the world calls it),
    with the default process group started if the stage has none (gloo on CPU, NCCL on CUDA)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    key = (layout.world_size, layout.tp)
    if key not in _MESHES:
        cuda = torch.cuda.is_available()
        if not dist.is_initialized():
            export_slurm_ranks()
            if cuda:
                torch.cuda.set_device(layout.local_rank)
            dist.init_process_group("nccl" if cuda else "gloo")
        _MESHES[key] = init_device_mesh("cuda" if cuda else "cpu", (layout.data_world, layout.tp),
                                        mesh_dim_names=("dp", "tp"))
        log.info("target layout: %d group(s) of %d tensor-parallel rank(s); rank %d is tp rank %d of group %d",
                 layout.data_world, layout.tp, layout.rank, layout.tp_rank, layout.data_rank)
    return _MESHES[key]


def exit_rank() -> None:
    """Ends a process that ran as one rank of several (rank_info().world_size > 1) once its stage has finished:
    non-daemon threads joined, the atexit handlers run, output flushed, then os._exit(0), skipping only the
    interpreter's teardown. A single process returns and exits as usual.

    Why: a DistributedDataParallel module keeps its gloo process group alive past destroy_process_group (torch
    2.13), so the group's worker threads outlive the stage. A worker that drops a finished collective's last
    reference to a tensor Python also saw must take the GIL; during the interpreter's teardown that aborts the
    rank ("terminate called without an active exception", SIGABRT) and torchrun then fails the whole run after
    every result was written. It is a race: about one two-process training run in 25 on 2 cores
    (tests/support/gloo_exit.py makes it likely)."""
    if rank_info().world_size <= 1:
        return
    import atexit
    import sys
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # W&B's, logging's flush: everything a normal exit runs before the teardown
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)
