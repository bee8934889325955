"""Hydra schema of the train stage: `HeadConfig` (which head, its training objective) and `TrainConfig`
(optimization, batching, checkpointing, distributed). See pipeline/train/run.py for the stage layout."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class HeadConfig:
    kind: str = "eagle3"  # eagle3 | eagle1
    name: str = "eagle3"  # output folder name: outputs/<experiment>/train/<name>
    draft_vocab_size: int = 32000  # eagle3 only; capped at the distinct tokens seen
    ttt_steps: int = 7  # eagle3 training-time-test rounds
    ttt_decay: float = 0.8  # weight of round i is decay**i
    # eagle3: "random" as the official EAGLE-3 trainer; "target" starts lm_head/norm as the target's
    # (draft-vocab rows, final norm; as speculators does for lm_head). On the SmolLM2 quality dump "target"
    # was worse (val round-0 accuracy 0.144 against 0.203 at step 50, docs/results.md), hence the default.
    lm_head_init: str = "random"
    rope_theta: float = 10000.0
    fc_bias: bool = False  # eagle1
    feature_loss_weight: float = 1.0  # eagle1
    token_loss_weight: float = 0.1  # eagle1
    feature_noise: float = 0.2  # eagle1: uniform noise scale on input features


@dataclass
class TrainConfig:
    epochs: int = 1
    max_steps: Optional[int] = None  # cap on optimizer steps; the LR schedule spans the capped run
    lr: float = 3e-4
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | linear | constant
    grad_clip: float = 0.5
    # Micro-batch size in padded tokens (rows x longest row); a row longer than this is a batch by itself.
    micro_batch_tokens: int = 4096
    # Micro-batches per optimizer step PER PROCESS: the global batch is grad_accum x world_size
    # micro-batches, so 1 process with grad_accum=2 and 2 processes with grad_accum=1 train identically.
    grad_accum: int = 1
    bucket_size: int = 256  # samples sorted by length together before packing (per epoch, after shuffling)
    max_length: int = 2048
    val_fraction: float = 0.05
    # Train on a seeded random fraction of the training rows (validation rows unchanged): data-scaling runs.
    train_fraction: float = 1.0
    seed: int = 0
    save_every: int = 200  # checkpoint (and real-tau decode) every N optimizer steps; 0: only at the end
    keep_checkpoints: int = 2  # the last K checkpoints are kept
    eval_every: int = 200  # validation loss/accuracy every N steps (and at the end); 0: only at the end
    val_max_batches: Optional[int] = None  # cap on validation micro-batches per evaluation
    log_every: int = 10  # console lines; metrics.jsonl and W&B get every step
    tau_prompts: int = 2  # validation prompts decoded with the real tree decoder at each checkpoint
    tau_max_new_tokens: int = 48
    plot: bool = True  # curves.png in the train dir at the end
    # auto (bf16 autocast where bf16 is fast: GPUs, AMX/AVX512-BF16 CPUs; see pipeline/precision.py) | no | bf16
    mixed_precision: str = "auto"
    # A DeepSpeed JSON (e.g. conf/deepspeed/zero2.json); GPU only. Model code stays single-device either way.
    deepspeed_config: Optional[str] = None
    resume: bool = True  # continue from the last checkpoint in the train dir (false: refuse a non-empty dir)
