"""Outputs written before the restructuring of heads, export formats and typed config (the tree in
tests/data/pre_restructure/, made by make_tree.py there with commit 218f7f2) keep working: the dump reads,
the finished EAGLE-3 head evaluates and exports, and the killed EAGLE-1 training resumes from its checkpoint
to the end."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.config import DataConfig, EagletConfig, EvalConfig, TargetConfig, WandbConfig
from pipeline.heads import head_config
from pipeline.hidden_states.reader import DumpReader
from pipeline.train import checkpoint as ckpt
from pipeline.train.config import TrainConfig
from pipeline.train.metrics import read_metrics

TREE = Path(__file__).parent / "data" / "pre_restructure" / "tree"


def config(root: Path, model_dir: Path, kind: str) -> EagletConfig:
    """The settings make_tree.py trained with, under the new code's config classes."""
    return EagletConfig(
        name="old", output_root=str(root), target=TargetConfig(name="tiny", path=str(model_dir), gguf_package=None),
        data=DataConfig(max_length=256), wandb=WandbConfig(mode="disabled"),
        head=head_config(kind, **({"ttt_steps": 3, "draft_vocab_size": 200} if kind == "eagle3" else {})),
        train=TrainConfig(epochs=4, lr=3e-3, warmup_steps=2, micro_batch_tokens=256, save_every=4, eval_every=4,
                          val_fraction=0.2, tau_prompts=0, plot=False, seed=0, mixed_precision="no"),
        eval=EvalConfig(limit=2, max_new_tokens=16, baseline=False))


@pytest.fixture
def old_tree(tmp_path) -> Path:
    shutil.copytree(TREE, tmp_path / "outputs")
    return tmp_path / "outputs"


def test_old_dump_reads_and_old_head_evaluates_and_exports(old_tree, tiny_model_dir):
    from pipeline.eval.run import main as evaluate
    from pipeline.export.run import main as export

    cfg = config(old_tree, tiny_model_dir, "eagle3")
    reader = DumpReader(cfg.stage_dir("dump"))
    assert len(reader) > 0 and reader.layer_ids == [2, 4, 5]
    summary = evaluate(cfg)
    assert summary["complete"] and summary["tau"] >= 1.0
    out = export(cfg)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


def test_old_killed_training_resumes_to_the_end(old_tree, tiny_model_dir):
    from pipeline.train.run import main as train

    cfg = config(old_tree, tiny_model_dir, "eagle1")
    train_dir = cfg.stage_dir("train")
    assert ckpt.latest_checkpoint(train_dir).name == "step-4" and not (train_dir / "manifest.json").exists()
    logged = [r["step"] for r in read_metrics(train_dir / "metrics.jsonl") if "train/loss" in r]
    assert max(logged) == 5  # the old run logged past its last checkpoint before the kill
    train(cfg)
    steps = [r["step"] for r in read_metrics(train_dir / "metrics.jsonl") if "train/loss" in r]
    manifest = json.loads((train_dir / "manifest.json").read_text())
    assert steps == list(range(1, manifest["counts"]["steps"] + 1))  # cut back to step 4, then continued
