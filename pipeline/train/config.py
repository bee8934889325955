"""Hydra schema of the train stage: `TrainConfig` (optimization, batching, checkpointing, distributed). What
to train is `HeadConfig` (pipeline/heads/config.py). See pipeline/train/run.py for the stage layout."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pipeline.choices import Choice


class Schedule(Choice):
    cosine = "cosine"  # warmup, then cosine from lr to lr * min_lr_ratio
    linear = "linear"  # warmup, then linear to lr * min_lr_ratio
    constant = "constant"  # warmup, then lr


class TrainSource(Choice):
    dump = "dump"  # the dump stage's shards: states computed once, reused by every epoch and head
    online = "online"  # the target runs in the training job; states never touch the disk (online.py)


class MixedPrecision(Choice):
    auto = "auto"  # bf16 autocast where bf16 is fast (GPUs, AMX/AVX512-BF16 CPUs; pipeline/precision.py)
    no = "no"
    bf16 = "bf16"


class Select(Choice):
    last = "last"  # final/ is the last step's head
    # final/ is the checkpoint whose decoded tau (the tau probe, tau_prompts) was best, kept in best/ meanwhile:
    # tau can turn down while the loss still falls.
    tau = "tau"


class OnNonFinite(Choice):
    fail = "fail"
    skip = "skip"


class OnScheduleChange(Choice):
    refuse = "refuse"  # a resume whose lr schedule differs from its checkpoint's stops, naming both
    # the new schedule (its lr included) from the resumed step on, recorded in the manifest's schedule_changes
    apply = "apply"


@dataclass
class TrainConfig:
    source: TrainSource = TrainSource.dump
    epochs: int = 1
    max_steps: Optional[int] = None  # cap on optimizer steps; the LR schedule spans the capped run
    lr: float = 3e-4
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 20
    schedule: Schedule = Schedule.cosine
    grad_clip: float = 0.5
    # Micro-batch size in padded tokens (rows x longest row); a row longer than this is a batch by itself.
    micro_batch_tokens: int = 4096
    # Micro-batches per optimizer step PER PROCESS: the global batch is grad_accum x world_size
    # micro-batches, so 1 process with grad_accum=2 and 2 processes with grad_accum=1 train identically.
    grad_accum: int = 1
    bucket_size: int = 256  # samples sorted by length together before packing (per epoch, after shuffling)
    max_length: int = 2048
    val_fraction: float = 0.05
    # Train on a seeded random fraction of the training rows (validation rows and the EAGLE-3 draft vocabulary,
    # counted over the whole training split, unchanged): data-scaling runs.
    train_fraction: float = 1.0
    seed: int = 0
    save_every: int = 200  # checkpoint (and real-tau decode) every N optimizer steps; 0: only at the end
    keep_checkpoints: int = 2  # the last K checkpoints are kept
    # Write scheduled checkpoints in a background thread from a CPU-memory snapshot: the loop waits for the
    # snapshot only (a large head's save takes seconds to minutes; bench/bench_checkpoint.py). A stop request's
    # checkpoint is whole before exit either way; a kill -9 during a background write resumes from the one before.
    async_save: bool = False
    eval_every: int = 200  # validation loss/accuracy every N steps (and at the end); 0: only at the end
    val_max_batches: Optional[int] = None  # cap on validation micro-batches per evaluation
    log_every: int = 10  # console lines; metrics.jsonl and W&B get every step
    tau_prompts: int = 2  # validation prompts decoded with the real tree decoder at each checkpoint
    tau_max_new_tokens: int = 48
    select: Select = Select.last  # which head becomes final/: the last, or the best by decoded tau
    # select=tau: stop once this many probes in a row decoded no better tau than the best (None: train on).
    patience: Optional[int] = None
    plot: bool = True  # curves.png in the train dir at the end
    mixed_precision: MixedPrecision = MixedPrecision.auto
    # A DeepSpeed JSON (e.g. conf/deepspeed/zero2.json); GPU only. Model code stays single-device either way.
    deepspeed_config: Optional[str] = None
    resume: bool = True  # continue from the last checkpoint in the train dir (false: refuse a non-empty dir)
    # A carried run (pipeline/train/carry.py: bf16 weights, step, metrics; no optimizer state) to continue where the
    # train dir has no checkpoint: what a fresh machine has of a run that a committed carry holds.
    carry_from: Optional[str] = None
    carry_warmup_steps: int = 20  # after a carry the lr ramps again over N steps: AdamW's moments start anew
    # Check every dump shard's and the resumed checkpoint's sha256 before use (a corrupt file stops the run,
    # naming it). Costs one read of the dump per run (bench/bench_integrity.py); false if you verify otherwise.
    verify_inputs: bool = True
    # A non-finite hidden state, loss or gradient: `fail` stops with the step, shard and row; `skip` leaves the
    # rows (states) or the step (loss, gradient) out and counts them in the metrics (train/skipped_*).
    on_nonfinite: OnNonFinite = OnNonFinite.fail
    # A resume whose schedule (lr, schedule, warmup_steps, min_lr_ratio, and the total steps epochs/max_steps give
    # a decaying schedule) differs from its checkpoint's: `refuse`, or `apply` the new one from the resumed step.
    on_schedule_change: OnScheduleChange = OnScheduleChange.refuse

    def __post_init__(self) -> None:
        self.source = TrainSource.parse(self.source, "train.source")
        self.schedule = Schedule.parse(self.schedule, "train.schedule")
        self.mixed_precision = MixedPrecision.parse(self.mixed_precision, "train.mixed_precision")
        self.on_nonfinite = OnNonFinite.parse(self.on_nonfinite, "train.on_nonfinite")
        self.on_schedule_change = OnScheduleChange.parse(self.on_schedule_change, "train.on_schedule_change")
        self.select = Select.parse(self.select, "train.select")
        if self.select == Select.tau and self.tau_prompts < 1:
            raise ValueError("train.select=tau chooses by the decoded tau: it needs train.tau_prompts >= 1")
        if self.patience is not None and (self.select != Select.tau or self.patience < 1):
            raise ValueError("train.patience counts tau probes without a gain: it needs train.select=tau and a "
                             "value >= 1")
        if self.deepspeed_config:  # early (before stage=all's regen); Parallel holds every launcher to it
            refuse_skip_under_deepspeed(self.on_nonfinite, "train.deepspeed_config")


class TrainSetupError(ValueError):
    """Train settings that cannot run as launched (a pipeline error: one line at the command line)."""


def refuse_skip_under_deepspeed(on_nonfinite: OnNonFinite, asked_by: str) -> None:
    """The one rule of on_nonfinite under DeepSpeed: its engine steps inside backward, before the loop's verdict,
    so the loop cannot leave a step out (ZeRO-0 applies a NaN update, ZeRO-1/2 skip it on their own terms)."""
    if on_nonfinite == OnNonFinite.skip:
        raise TrainSetupError(f"train.on_nonfinite=skip cannot run under DeepSpeed ({asked_by}): DeepSpeed applies "
                              f"the step inside backward, before a non-finite one can be skipped; use "
                              f"train.on_nonfinite=fail (it stops at the first one, before any checkpoint holds it), "
                              f"or train without DeepSpeed")
