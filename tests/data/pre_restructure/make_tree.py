"""Writes the output tree of tests/test_compat.py with eaglet as it was before the restructuring of the heads,
formats and typed config (commit 218f7f2): regen and dump of 10 demo prompts on the tests' tiny Llama, an
EAGLE-3 head trained to the end, and an EAGLE-1 training killed after step 5 (last checkpoint: step 4).
Run it from a checkout of that commit, with its root and its tests/ (conftest's builders) on PYTHONPATH:

    git worktree add /tmp/eaglet-old 218f7f2
    cd /tmp/eaglet-old && PYTHONPATH=.:tests python <repo>/tests/data/pre_restructure/make_tree.py \
        <repo>/tests/data/pre_restructure/tree
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import build_tiny_llama, build_tiny_tokenizer  # the old checkout's tests/conftest.py
from pipeline.config import DataConfig, EagletConfig, HeadConfig, TargetConfig, WandbConfig
from pipeline.hidden_states.config import DumpConfig
from pipeline.regen.config import RegenConfig
from pipeline.train.config import TrainConfig

NAME = "old"


def config(out: Path, model_dir: Path, kind: str) -> EagletConfig:
    return EagletConfig(
        name=NAME, output_root=str(out), target=TargetConfig(name="tiny", path=str(model_dir), gguf_package=None),
        data=DataConfig(max_length=256), wandb=WandbConfig(mode="disabled"),
        regen=RegenConfig(backend="hf", batch_size=5, batches_per_shard=1, max_new_tokens=24, limit=10,
                          progress=False),
        dump=DumpConfig(),
        head=HeadConfig(kind=kind, name=kind, ttt_steps=3, draft_vocab_size=200),
        train=TrainConfig(epochs=4, lr=3e-3, warmup_steps=2, micro_batch_tokens=256, save_every=4, eval_every=4,
                          val_fraction=0.2, tau_prompts=0, plot=False, seed=0, mixed_precision="no"))


def main(out: Path) -> None:
    import torch

    torch.set_num_threads(2)
    model_dir = out.parent / "tiny_model"  # rebuilt by the test from the same seed; not kept
    tok = build_tiny_tokenizer()
    build_tiny_llama(len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    shutil.rmtree(out, ignore_errors=True)
    from pipeline.hidden_states.run import main as dump
    from pipeline.regen.run import main as regen
    from pipeline.train.run import main as train

    regen(config(out, model_dir, "eagle3"))
    dump(config(out, model_dir, "eagle3"))
    train(config(out, model_dir, "eagle3"))
    # EAGLE-1, killed by the old code's own fault injection after step 5 is logged.
    script = ("from make_tree import config\nfrom pathlib import Path\nfrom pipeline.train.run import main\n"
              f"main(config(Path({str(out)!r}), Path({str(model_dir)!r}), 'eagle1'))\n")
    here_first = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    killed = subprocess.run([sys.executable, "-c", script],
                            env={**os.environ, "PYTHONPATH": here_first, "EAGLET_TRAIN_FAULT": "kill:5"})
    assert killed.returncode == -9, killed.returncode
    shutil.rmtree(model_dir)
    for junk in out.rglob("wandb"):
        shutil.rmtree(junk)


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
