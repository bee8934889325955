"""The one place where the single-device training objective becomes a data-parallel one.

accelerate picks the regime from the launch environment: one process; DDP over gloo on CPU or NCCL on GPU
(`torchrun --nproc-per-node N` / `accelerate launch` / srun); or DeepSpeed ZeRO from a JSON config
(`train.deepspeed_config=conf/deepspeed/zero2.json`, or `accelerate launch` with a DeepSpeed plugin; GPUs only).
Heads, losses and the loop never see a wrapper: they call the methods here."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable, Optional

import torch
from torch import nn

from pipeline.dist import RankInfo, export_slurm_ranks, target_layout

from .config import MixedPrecision, OnNonFinite, TrainConfig, TrainSetupError, refuse_skip_under_deepspeed

log = logging.getLogger(__name__)

DS_TAG = "deepspeed"  # DeepSpeed's own sub-directory inside a checkpoint


def resolve_mixed_precision(name: str, cuda: bool) -> str:
    """auto: bf16 autocast where bf16 compute is fast (GPUs; AMX/AVX512-BF16 CPUs, pipeline/precision.py),
    fp32 elsewhere. Master weights and optimizer states stay fp32 either way."""
    from pipeline.precision import fast_bf16

    name = MixedPrecision.parse(name, "train.mixed_precision")
    if name == MixedPrecision.auto:
        return "bf16" if fast_bf16("cuda" if cuda else "cpu") else "no"
    return str(name)


def deepspeed_asked_by(cfg: TrainConfig) -> Optional[str]:
    """What asks for DeepSpeed, named for messages, or None: train.deepspeed_config, or `accelerate launch` with a
    DeepSpeed plugin (`--config_file conf/accelerate/deepspeed_zero2.yaml`, or `--use_deepspeed` with or without a
    file), which tells its processes through ACCELERATE_USE_DEEPSPEED; on a GPU accelerate then runs DeepSpeed
    whatever the train config says."""
    if cfg.deepspeed_config:
        return "train.deepspeed_config"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return "accelerate launch's DeepSpeed plugin, ACCELERATE_USE_DEEPSPEED=true"
    return None


class Parallel:
    def __init__(self, cfg: TrainConfig, tensor_parallel: int = 1):
        """`tensor_parallel`: N > 1 when each group of N ranks computes its states with one tensor-parallel target
        (train.source=online): the group's ranks then train on the same micro-batches (the data split is over
        groups, `data_rank` of `data_world_size`) and the head stays DDP over every rank: the group's identical
        gradients average to the gradient of data parallelism over the groups."""
        from accelerate import Accelerator, DeepSpeedPlugin, DistributedDataParallelKwargs
        from accelerate.utils import DistributedType

        export_slurm_ranks()
        cuda = torch.cuda.is_available()
        plugin = None
        if asked_by := deepspeed_asked_by(cfg):
            refuse_skip_under_deepspeed(cfg.on_nonfinite, asked_by)  # however it was launched, before any step
            # Only GPUs: DeepSpeed's CPU backend needs oneCCL; CPU data parallelism is DDP over gloo.
            if not cuda:
                raise TrainSetupError(f"DeepSpeed ({asked_by}) needs CUDA GPUs; on CPU leave it unset (plain DDP "
                                      f"over gloo)")
            # Accumulation and clipping come from the train config ("auto" in the JSON), as without DeepSpeed.
            # No train.deepspeed_config: the file accelerate launch names (ACCELERATE_DEEPSPEED_CONFIG_FILE), or
            # with `--use_deepspeed` alone the settings of its other variables.
            plugin = DeepSpeedPlugin(hf_ds_config=cfg.deepspeed_config or None,
                                     gradient_accumulation_steps=cfg.grad_accum, gradient_clipping=cfg.grad_clip)
        self.accelerator = Accelerator(
            cpu=not cuda,
            mixed_precision=resolve_mixed_precision(cfg.mixed_precision, cuda),
            gradient_accumulation_steps=cfg.grad_accum,
            deepspeed_plugin=plugin,
            # The objective's buffers (frozen target lm_head, vocab maps) are identical on every rank by
            # construction; broadcasting them before every forward would cost a vocab x hidden copy.
            kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
        )
        self.deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        if self.deepspeed and cfg.on_nonfinite == OnNonFinite.skip:  # the regime accelerate runs is the truth
            self.end()
            refuse_skip_under_deepspeed(cfg.on_nonfinite, asked_by or "chosen by accelerate")
        self.layout = target_layout(tensor_parallel, RankInfo(self.rank, self.world_size,
                                                              self.accelerator.local_process_index))

    # -- topology --------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def data_rank(self) -> int:
        """This rank's place in the data split: its tensor-parallel group's index (its rank without TP)."""
        return self.layout.data_rank

    @property
    def data_world_size(self) -> int:
        return self.layout.data_world

    @property
    def mixed_precision(self) -> str:
        return self.accelerator.mixed_precision

    @property
    def precision(self) -> str:
        """The compute dtype's name, as every stage manifest records it."""
        return "bfloat16" if self.mixed_precision == "bf16" else "float32"

    # -- wrapping ----------------------------------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        """Returns the wrapped (DDP / DeepSpeed engine / autocast-forward) model and optimizer. The LR
        scheduler stays ours: accelerate's scheduler wrapper steps it once per process."""
        return self.accelerator.prepare(model, optimizer)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.accelerator.unwrap_model(model)

    def accumulate(self, model: nn.Module):
        """Context for one micro-batch: gradients are all-reduced (and the optimizer steps) only on the last
        micro-batch of a step; earlier ones run under no_sync."""
        return self.accelerator.accumulate(model)

    @property
    def sync_gradients(self) -> bool:
        return self.accelerator.sync_gradients

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() scaled by 1/grad_accum (DeepSpeed scales inside its engine)."""
        self.accelerator.backward(loss)

    def clip_grad_norm(self, parameters: Iterable[nn.Parameter], max_norm: float) -> Optional[float]:
        """Clips the all-reduced gradients; returns the pre-clip global norm (DeepSpeed clips in its step
        and reports the norm it saw)."""
        norm = self.accelerator.clip_grad_norm_(list(parameters), max_norm)
        return None if norm is None else float(norm)

    def autocast(self):
        """The training precision for forwards outside the wrapped model (validation)."""
        return self.accelerator.autocast()

    # -- collectives -------------------------------------------------------------------------------------------
    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        out = tensor.detach().to(self.device, copy=True)
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM)
        return out

    def reduce_data_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the data split: each tensor-parallel group's value once (its first rank's; the group's ranks
        computed the same micro-batches). Without TP, `reduce_sum`."""
        if not self.layout.sharded:
            return self.reduce_sum(tensor)
        return self.reduce_sum(tensor if self.layout.is_writer else torch.zeros_like(tensor))

    def any(self, flag: bool) -> bool:
        """True on every rank when any rank says True (e.g. a SIGTERM that reached one task first)."""
        return bool(self.reduce_sum(torch.tensor([float(flag)], device=self.device)).item() > 0)

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    def end(self) -> None:
        """Destroys the process group and accelerate's process-wide singletons, so another run in the same
        process (tests, notebooks) can pick other settings."""
        from accelerate.state import AcceleratorState, GradientState

        self.accelerator.end_training()
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    # -- state that lives in the wrapper (DeepSpeed keeps partitioned optimizer states) -------------------------
    def save_engine_state(self, model: nn.Module, directory: Path) -> None:
        """DeepSpeed only (a collective): its ZeRO-partitioned optimizer states, one file per rank."""
        if self.deepspeed:
            model.save_checkpoint(str(directory), tag=DS_TAG)

    def load_engine_state(self, model: nn.Module, directory: Path) -> None:
        if self.deepspeed:
            model.load_checkpoint(str(directory), tag=DS_TAG, load_optimizer_states=True,
                                  load_lr_scheduler_states=False)
