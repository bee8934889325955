"""A tiny dump in several shards and the short train runs the integrity tests make on it (test_integrity.py,
shared with test_full_disk.py)."""
from __future__ import annotations

from pathlib import Path

from tests.support.tiny_runs import as_config, overrides

DUMP = {"shard_bytes": 1 << 20}  # about 4 shards


def train_cfg(root: Path, model_dir: Path, name: str = "h", **train):
    train = {"epochs": 1, "save_every": 0, "eval_every": 0, "tau_prompts": 0, "plot": False, **train}
    return as_config(overrides(root, model_dir, "eagle3", name, **train))
