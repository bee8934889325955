"""Training metrics: statistics summed over micro-batches and ranks, the numbers derived from them (per-round
accuracy, simulated tau), and their sinks -- metrics.jsonl (every step), W&B (rank 0) and curves.png.

Keys: `train/loss`, `train/loss_<k>` (EAGLE-3 round k), `train/acc_<k>`, `train/sim_tau`, `lr`, `grad_norm`,
`tokens_per_s`, `epoch`; the same under `val/` at evaluations; `eval/tau` (the real tree decoder) at
checkpoints."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Callable, Optional

import torch

from pipeline.files import atomic_write_text
from pipeline.heads.losses import simulated_tau
from pipeline.tracking import start_wandb_run

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"


# ---------------------------------------------------------------------------------------------------------
# statistics


def add_stats(sums: dict[str, torch.Tensor], stats: dict[str, torch.Tensor]) -> None:
    """Accumulate an objective's statistics on the CPU in fp64 (exact enough to compare runs; one small copy
    per micro-batch; reduce_stats moves them to the collective's device)."""
    for k, v in stats.items():
        v = v.detach().reshape(-1).to("cpu", torch.float64)
        sums[k] = sums[k] + v if k in sums else v


def reduce_stats(sums: dict[str, torch.Tensor], reduce_sum: Callable[[torch.Tensor], torch.Tensor]
                 ) -> dict[str, torch.Tensor]:
    """One all-reduce for all statistics: flatten in key order, reduce, split back."""
    keys = sorted(sums)
    flat = reduce_sum(torch.cat([sums[k] for k in keys]))
    out, i = {}, 0
    for k in keys:
        n = sums[k].numel()
        out[k] = flat[i:i + n].cpu()
        i += n
    return out


def derive(sums: dict[str, torch.Tensor], prefix: str) -> dict[str, float]:
    """Losses are means over micro-batches (each micro-batch's loss is a mean over its positions); accuracy of
    round k is correct/total over all positions of all micro-batches; sim_tau = 1 + sum_k prod_{j<=k} acc_j."""
    n = float(sums["micro"][0])
    out = {f"{prefix}/loss": float(sums["loss"][0]) / n}
    for k in ("feature_loss", "token_loss"):
        if k in sums:
            out[f"{prefix}/{k}"] = float(sums[k][0]) / n
    if "round_loss" in sums and sums["round_loss"].numel() > 1:
        out.update({f"{prefix}/loss_{k}": float(v) / n for k, v in enumerate(sums["round_loss"])})
    acc = (sums["round_correct"] / sums["round_total"].clamp_min(1)).tolist()
    out.update({f"{prefix}/acc_{k}": a for k, a in enumerate(acc)})
    out[f"{prefix}/sim_tau"] = simulated_tau(acc)
    out[f"{prefix}/tokens"] = float(sums["tokens"][0])
    return out


# ---------------------------------------------------------------------------------------------------------
# sinks


class MetricsLog:
    """metrics.jsonl (one JSON object per line, each with its "step") and W&B, on the main rank only.

    On resume the file is cut back to the checkpoint's step, so after any number of interruptions it reads
    exactly like one uninterrupted run."""

    def __init__(self, train_dir: Path, enabled: bool, wandb_cfg=None, wandb_config: Optional[dict] = None,
                 run_name: Optional[str] = None):
        self.path = Path(train_dir) / METRICS_FILE
        self.enabled = enabled
        self.wandb_cfg, self.wandb_config, self.run_name = wandb_cfg, wandb_config or {}, run_name
        self.run = None

    def open(self, resume_step: int) -> None:
        """Start logging after step `resume_step` (0: a fresh run)."""
        if not self.enabled:
            return
        records = [r for r in read_metrics(self.path) if r["step"] <= resume_step] if resume_step else []
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in records))
        if self.wandb_cfg is not None:
            self.run = init_wandb(self.wandb_cfg, self.path.parent, self.wandb_config, self.run_name)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if k != "step"}, step=step)

    def close(self, summary: Optional[dict] = None) -> None:
        if self.run is not None:
            if summary:
                self.run.summary.update({k: _plain(v) for k, v in summary.items()})
            self.run.finish()
            self.run = None


def _plain(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf
    return v


def read_metrics(path: Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def init_wandb(wandb_cfg, train_dir: Path, config: dict, run_name: Optional[str]):
    return start_wandb_run(wandb_cfg, train_dir, config, run_name, job_type="train", resumable=True)


# ---------------------------------------------------------------------------------------------------------
# curves


def plot_curves(metrics_path: Path, out_png: Path, title: str = "") -> Path:
    """Loss, tau (simulated train/val and the real decoder's), per-round accuracy and lr against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)

    def series(key):
        pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0, 0]
    for key in ("train/loss", "val/loss"):
        ax.plot(*series(key), label=key, marker="o" if key.startswith("val") else None)
    ax.set_title("loss")
    ax = axes[0, 1]
    for key in ("train/sim_tau", "val/sim_tau", "eval/tau"):
        ax.plot(*series(key), label=key, marker=None if key.startswith("train") else "o")
    ax.set_title("tau (sim: 1 + sum_k prod_j<=k acc_j; eval: decoder)")
    ax = axes[1, 0]
    rounds = sorted({int(k.rsplit("_", 1)[1]) for r in records for k in r if k.startswith("val/acc_")})
    for k in rounds:
        ax.plot(*series(f"val/acc_{k}"), label=f"val/acc_{k}", marker="o")
    ax.set_title("validation accuracy per round")
    ax = axes[1, 1]
    ax.plot(*series("lr"), label="lr")
    ax.set_title("learning rate")
    for ax in axes.flat:
        ax.set_xlabel("step")
        if ax.has_data():
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png
