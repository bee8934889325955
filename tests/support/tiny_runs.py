"""Tiny dump and train runs: the tiny target and its conversations, a tiny dump made by the real dump stage,
and train-run overrides usable both as Hydra CLI arguments and as a typed config (test_train.py and the tests
that train, resume, export or damage such runs); the settings that make such a run train online."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from pipeline.config import EagletConfig, TargetConfig, WandbConfig
from pipeline.data.config import DataConfig, SourceConfig
from pipeline.heads import head_config
from pipeline.hidden_states.config import DumpConfig
from pipeline.train.config import TrainConfig
from pipeline.train.metrics import read_metrics
from tests.support.paths import REPO

EXPERIMENT = "t"


def tiny_target(model_dir: Path) -> TargetConfig:
    return TargetConfig(name="tiny", path=str(model_dir), gguf_package=None, gguf_file=None, hub_id=str(model_dir))


def tiny_data(shared_data: Path, rows: int = 48) -> DataConfig:
    """The tiny dump's conversations: alpaca demo conversations, <= 96 tokens."""
    source = SourceConfig(path=str(shared_data / "alpaca_en_demo" / "alpaca_en_demo.json"), limit=rows)
    return DataConfig(name="tiny", sources=[source], max_length=96)


def build_tiny_dump(root: Path, model_dir: Path, shared_data: Path, rows: int = 48, **dump) -> Path:
    """outputs root with <root>/t/dump written by the dump stage from `tiny_data` (DumpConfig fields in `dump`)."""
    from pipeline.hidden_states.run import main as dump_main

    cfg = EagletConfig(stage="dump", name=EXPERIMENT, output_root=str(root), target=tiny_target(model_dir),
                       data=tiny_data(shared_data, rows), dump=DumpConfig(input="data", **dump))
    dump_main(cfg)
    return root


# Train settings of the tests: 41 dump rows -> 35 train / 6 validation rows, 7 steps per epoch at 512 tokens.
BASE_TRAIN = dict(epochs=2, lr=3e-3, warmup_steps=2, micro_batch_tokens=512, grad_accum=1, save_every=4,
                  eval_every=4, log_every=1, val_fraction=0.15, tau_prompts=1, tau_max_new_tokens=12, seed=0)


def overrides(root: Path, model_dir: Path, kind: str, name: str, **train) -> dict:
    """Dotted-key settings of a tiny train run; `as_cli` and `as_config` give the same run two ways."""
    d = {"stage": "train", "name": EXPERIMENT, "output_root": str(root), "target.name": "tiny",
         "target.path": str(model_dir), "head.kind": kind, "head.name": name, "wandb.mode": "disabled"}
    options = head_config(kind)  # the kind's own options only: another kind's fails at compose
    d.update({f"head.{k}": v for k, v in (("ttt_steps", 3), ("draft_vocab_size", 200)) if hasattr(options, k)})
    d.update({f"train.{k}": v for k, v in {**BASE_TRAIN, **train}.items()})
    return d


def as_cli(d: dict) -> list[str]:
    head = d["head.kind"]
    args = [f"head={head}", "target=hf"]
    for k, v in d.items():
        if k == "head.kind":
            continue
        args.append(f"{k}={'null' if v is None else v}")
    return args


def as_config(d: dict) -> EagletConfig:
    head = head_config(d["head.kind"], **{k[5:]: v for k, v in d.items() if k.startswith("head.") and k != "head.kind"})
    cfg = EagletConfig(target=tiny_target(Path(d["target.path"])), head=head, train=TrainConfig(), wandb=WandbConfig())
    for key, value in d.items():
        if key.startswith("head."):
            continue
        obj, *path = key.split(".")
        if not path:
            setattr(cfg, obj, value)
            continue
        setattr(getattr(cfg, obj), path[0], value)
    return cfg


def run_cli(d: dict, env: dict | None = None, timeout: int = 120, launcher: list[str] | None = None,
            fault: str | None = None):
    """`python -m pipeline.run` with `d` as overrides; `fault` ("<event>:<step>:<SIGNAL>") runs it through
    tests/support/faulty_run.py, which signals the process at that point of training."""
    entry = ["-m", "tests.support.faulty_run", fault] if fault else ["-m", "pipeline.run"]
    cmd = (launcher or [sys.executable]) + entry + as_cli(d)
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "WANDB_MODE": "disabled", **(env or {})})


def train_losses(train_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(train_dir / "metrics.jsonl") if "train/loss" in r}


# ---------------------------------------------------------------------------------------------------------
# online (train.source=online, test_online.py)


def online_config(root: Path, model_dir: Path, shared_data: Path, **train):
    """A train config reading the tiny dump's conversations (dump.input=data) under `root`."""
    cfg = as_config(overrides(root, model_dir, "eagle3", "p", **train))
    cfg.dump = dataclasses.replace(cfg.dump, input="data")
    cfg.data = tiny_data(shared_data, rows=12)
    return cfg


def online_cli(shared_data: Path) -> dict:
    """The overrides that make a `run_cli` train run online on the tiny dump's conversations."""
    return {"train.source": "online", "dump.input": "data", "data.name": "tiny", "data.max_length": 96,
            "data.sources": f"[{{path: {shared_data}/alpaca_en_demo/alpaca_en_demo.json, limit: 48}}]"}
