"""target.tensor_parallel=N: each group of N consecutive ranks holds ONE target sharded by transformers' own tensor
parallelism (tp_plan "auto", gloo on CPU), on the tiny Llama (4 attention heads, 2 key/value heads: N=2).

A sharded forward sums the row-parallel matmuls (o_proj, down_proj) over the ranks in another order than one
matmul does, so states differ from an unsharded forward by fp32 reassociation only: a few ulps per layer, within
1e-5 of the tiny model's O(1) states through its 8 layers (measured: ~1e-6 on the final state). Everything the
ranks must agree on (token ids, masks, row order, the data split, the decoded tokens) is compared exactly.
- dump: a TP=2 dump on 4 ranks (2 groups, each one dumper; transformers then wraps the target in FSDP2 over the
  groups, `dp_replicate`) equals a TP=1 dump row for row, and a TP=1 reader accepts it (same fingerprint);
- online training: one TP=2 group (2 ranks) reproduces one process's losses, the head DDP over both ranks;
- eval: with a TP=2 target the fp32 greedy tree decoding equals vanilla greedy, and the TP=1 eval's answers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.dist import LayoutError, RankInfo, target_layout
from pipeline.eval.run import main as eval_main
from pipeline.hidden_states.reader import DumpReader
from pipeline.manifest import load_manifest
from pipeline.target import TargetError, check_tensor_parallel
from pipeline.train import run as train_run
from tests.support.config import compose_cfg
from tests.support.paths import REPO
from tests.support.tiny_runs import (
    EXPERIMENT,
    build_tiny_dump,
    online_cli,
    online_config,
    overrides,
    run_cli,
    tiny_data,
    train_losses,
)

pytestmark = pytest.mark.cluster

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
TORCHRUN4 = TORCHRUN[:-1] + ["4"]
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
ROWS = 24
QUESTIONS = [{"question_id": 1, "category": "math", "turns": ["What is 12 times 7?", "And 12 times 8?"]},
             {"question_id": 2, "category": "chat", "turns": ["Write a short poem about the sea."]}]


def cli(args: list[str], launcher: list[str] | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    out = subprocess.run((launcher or [sys.executable]) + ["-m", "pipeline.run", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=timeout, env={**os.environ, **ENV})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out


def dump_args(root: Path, model_dir: Path, shared_data: Path) -> list[str]:
    """The dump of `build_tiny_dump` (tests/support/tiny_runs.py: the same conversations and settings) as CLI
    overrides."""
    return [f"output_root={root}", f"name={EXPERIMENT}", "stage=dump", "target=hf", f"target.path={model_dir}",
            "target.name=tiny", f"target.hub_id={model_dir}", "dump.input=data", "data.name=tiny",
            "data.max_length=96", "dump.shard_bytes=100000",
            f"data.sources=[{{path: {shared_data}/alpaca_en_demo/alpaca_en_demo.json, limit: {ROWS}}}]"]


# ---------------------------------------------------------------------------------------------------------
# the layout and its refusals


def test_layout_splits_the_world_into_groups_of_consecutive_ranks():
    layouts = [target_layout(2, RankInfo(r, 4, r)) for r in range(4)]
    assert [(t.data_rank, t.tp_rank, t.is_writer) for t in layouts] == [(0, 0, True), (0, 1, False), (1, 0, True),
                                                                        (1, 1, False)]
    assert {t.data_world for t in layouts} == {2} and layouts[3].data == RankInfo(1, 2, 3)
    one = target_layout(1, RankInfo(3, 4, 3))  # tensor_parallel=1: every rank its own replica, as before
    assert (one.data_rank, one.data_world, one.is_writer, one.sharded) == (3, 4, True, False)
    assert one.agree({"x": 1}) == {"x": 1}


def test_refuses_a_world_size_or_head_count_that_n_does_not_divide(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    with pytest.raises(LayoutError, match="target.tensor_parallel=3 does not divide the world size 2"):
        target_layout(3, RankInfo(0, 2, 0))
    with pytest.raises(TargetError, match=r"4 attention heads and 2 key/value heads; N must divide both "
                                          r"\(possible: \[1, 2\]\)"):
        check_tensor_parallel(config, 4, "tiny")
    check_tensor_parallel(config, 2, "tiny")


# ---------------------------------------------------------------------------------------------------------
# dump


@pytest.fixture(scope="module")
def dumps(tmp_path_factory, tiny_model_dir, shared_data):
    """(TP=1 dump root, TP=2 dump root): the same conversations, in-process and on 4 ranks (2 TP=2 groups)."""
    one = build_tiny_dump(tmp_path_factory.mktemp("tp1"), tiny_model_dir, shared_data, rows=ROWS,
                          shard_bytes=100000)
    two = tmp_path_factory.mktemp("tp2")
    cli(dump_args(two, tiny_model_dir, shared_data) + ["target.tensor_parallel=2"], launcher=TORCHRUN4)
    return one, two


def test_a_tp2_dump_equals_a_tp1_dump_row_for_row(dumps):
    one, two = (root / EXPERIMENT / "dump" for root in dumps)
    m1, m2 = load_manifest(one, "dump"), load_manifest(two, "dump")
    assert (m1["tensor_parallel"], m2["tensor_parallel"]) == (1, 2)
    assert m2["target"] == m1["target"]  # the fingerprint does not depend on the layout
    assert m2["plan"]["key"] == m1["plan"]["key"] and len(m2["shards"]) == len(m1["shards"]) > 1
    assert m2["timings"]["this_run"]["world_size"] == 2  # the manifest's writer was one of 2 data ranks (groups)
    r1, r2 = DumpReader(one), DumpReader(two, expect_target=m1["target"])  # a TP=1 consumer accepts it
    assert len(r1) == len(r2) == ROWS - 1  # one of the conversations has no assistant turn
    worst = 0.0
    for i in range(len(r1)):
        a, b = r1[i], r2[i]
        assert a.id == b.id and torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        for x, y in ((a.aux_hidden, b.aux_hidden), (a.final_hidden, b.final_hidden)):
            torch.testing.assert_close(y, x, rtol=0, atol=1e-5)
            worst = max(worst, float((x - y).abs().max()))
    assert worst > 0  # the states were computed sharded (another summation order), not copied


# ---------------------------------------------------------------------------------------------------------
# online training and eval (one trained head, shared)


@pytest.fixture(scope="module")
def online(tmp_path_factory, tiny_model_dir, shared_data):
    """Online training, one process and one TP=2 group of 2 ranks (same global batch: grad_accum=1 each)."""
    root = tmp_path_factory.mktemp("online")
    common = dict(max_steps=4, epochs=2, save_every=4, eval_every=2, tau_prompts=1, tau_max_new_tokens=8)
    cfg = online_config(root, tiny_model_dir, shared_data, **common)  # one process, in this one
    cfg.train.source, cfg.head.name, cfg.data = "online", "one", tiny_data(shared_data, rows=48)  # = online_cli
    train_run.main(cfg)
    d = {**overrides(root, tiny_model_dir, "eagle3", "tp2", **common), **online_cli(shared_data),
         "target.tensor_parallel": 2}
    out = run_cli(d, env=ENV, launcher=TORCHRUN, timeout=240)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return root, {name: root / EXPERIMENT / "train" / name for name in ("one", "tp2")}


def test_online_training_with_one_tp2_group_reproduces_one_process(online):
    _, runs = online
    ref, got = train_losses(runs["one"]), train_losses(runs["tp2"])
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    assert len({round(v, 3) for v in ref.values()}) > 2  # the losses move: the comparison has teeth
    records = {name: [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
               for name, d in runs.items()}
    val = {name: [r["val/loss"] for r in recs if "val/loss" in r] for name, recs in records.items()}
    assert val["tp2"] == pytest.approx(val["one"], rel=1e-5) and len(val["one"]) == 3  # steps 0, 2, 4
    tau = {name: [r["eval/tau"] for r in recs if "eval/tau" in r] for name, recs in records.items()}
    assert tau["tp2"] == tau["one"] and len(tau["one"]) == 1  # the probe decoded on the TP target, losslessly
    manifest = load_manifest(runs["tp2"], "train")
    assert manifest["counts"]["world_size"] == 2 and manifest["source"] == "online"


def test_eval_with_a_tp2_target_is_lossless(online, tiny_model_dir):
    root, _ = online
    questions = root / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    args = [f"output_root={root}", f"name={EXPERIMENT}", "stage=eval", "target=hf", f"target.path={tiny_model_dir}",
            "target.name=tiny", f"target.hub_id={tiny_model_dir}", "head=eagle3", "head.name=tp2",
            "head.draft_vocab_size=200", "head.ttt_steps=3", f"eval.questions={questions}", "eval.max_new_tokens=24",
            "tree.depth=4", "tree.top_k=4", "tree.total_tokens=16", "wandb.mode=disabled"]
    one = compose_cfg(args + ["eval.run_name=tp1", "eval.baseline=false"])  # TP=1, in this process
    one.name = EXPERIMENT  # (compose_cfg names the run after the experiment group, as the CLI's ${hydra:} does)
    eval_main(one)
    cli(args + ["eval.run_name=tp2", "target.tensor_parallel=2"], launcher=TORCHRUN)
    runs = root / EXPERIMENT / "eval" / "tp2"
    s1, s2 = (json.loads((runs / r / "summary.json").read_text()) for r in ("tp1", "tp2"))
    assert s2["greedy_matches_baseline"] == "3/3" and s2["tensor_parallel"] == 2
    a1, a2 = ([json.loads(line) for line in (runs / r / "answers.jsonl").read_text().splitlines()]
              for r in ("tp1", "tp2"))
    assert [r["answer"] for r in a2] == [r["answer"] for r in a1] and all(r["new_tokens"] > 8 for r in a1)
    assert [r["accept_lengths"] for r in a2] == [r["accept_lengths"] for r in a1]
    assert s2["target"] == s1["target"]
