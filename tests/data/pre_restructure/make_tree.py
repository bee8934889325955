"""Writes the output tree of tests/test_compat.py with eaglet as it was before the restructuring of the heads,
formats and typed config (commit 218f7f2): regen and dump of 10 demo prompts on the tests' tiny Llama, an
EAGLE-3 head trained to the end, and an EAGLE-1 training killed after step 5 (last checkpoint: step 4).
Run it from a checkout of that commit:

    git worktree add /tmp/eaglet-old 218f7f2
    cd /tmp/eaglet-old && python <repo>/tests/data/pre_restructure/make_tree.py <repo>/tests/data/pre_restructure/tree
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests")]

from conftest import build_tiny_llama, build_tiny_tokenizer  # noqa: E402
from pipeline.config import DataConfig, EagletConfig, TargetConfig, WandbConfig  # noqa: E402
from pipeline.heads import head_config  # noqa: E402
from pipeline.hidden_states.config import DumpConfig  # noqa: E402
from pipeline.regen.config import RegenConfig  # noqa: E402
from pipeline.train.config import TrainConfig  # noqa: E402

NAME = "old"


def config(out: Path, model_dir: Path, kind: str) -> EagletConfig:
    return EagletConfig(
        name=NAME, output_root=str(out), target=TargetConfig(name="tiny", path=str(model_dir), gguf_package=None),
        data=DataConfig(max_length=256), wandb=WandbConfig(mode="disabled"),
        regen=RegenConfig(backend="hf", batch_size=5, batches_per_shard=1, max_new_tokens=24, limit=10,
                          progress=False),
        dump=DumpConfig(),
        head=head_config(kind, **({"ttt_steps": 3, "draft_vocab_size": 200} if kind == "eagle3" else {})),
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
    script = (f"import sys; sys.path[:0] = {[os.getcwd(), str(Path(__file__).parent)]!r}\n"
              "from make_tree import config\nfrom pathlib import Path\nfrom pipeline.train.run import main\n"
              f"main(config(Path({str(out)!r}), Path({str(model_dir)!r}), 'eagle1'))\n")
    killed = subprocess.run([sys.executable, "-c", script], env={**os.environ, "EAGLET_TRAIN_FAULT": "kill:5"})
    assert killed.returncode == -9, killed.returncode
    shutil.rmtree(model_dir)
    for junk in out.rglob("wandb"):
        shutil.rmtree(junk)


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
