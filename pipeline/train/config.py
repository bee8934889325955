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
    rope_theta: float = 10000.0
    fc_bias: bool = False  # eagle1
    feature_loss_weight: float = 1.0  # eagle1
    token_loss_weight: float = 0.1  # eagle1
    feature_noise: float = 0.2  # eagle1: uniform noise scale on input features


@dataclass
class TrainConfig:
    epochs: int = 1
    max_steps: Optional[int] = None
    lr: float = 3e-4
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | linear | constant
    grad_clip: float = 0.5
    micro_batch_tokens: int = 4096
    grad_accum: int = 1
    max_length: int = 2048
    val_fraction: float = 0.05
    seed: int = 0
    save_every: int = 200
    eval_every: int = 200
    log_every: int = 10
    tau_prompts: int = 2  # validation prompts decoded with the real tree decoder at each checkpoint
    mixed_precision: str = "auto"  # auto (bf16 on GPU, no on CPU) | no | bf16
    deepspeed_config: Optional[str] = None
    resume: bool = True
