"""train.source=online: the states a training batch gets from the target in the job equal the dump's, so an
online step equals an offline step; the stage trains, records its source, and refuses to switch source on resume.

Parity is asserted two ways, in float32 (the tests pin it: EAGLET_FAST_BF16=0):
- rows dumped alone and trained one per micro-batch: the online forward has the dump forward's exact shapes,
  so states, loss and every gradient are bitwise equal;
- rows packed several to a micro-batch: the dump computed them in other batches (other padding), and padded
  matmuls round differently. Each of the target's 8 layers then differs by a few fp32 ulps (eps = 1.2e-7,
  relative); through 8 layers and the head's 3 TTT rounds that stays within about 8 x 3 x 16 eps ~ 5e-5 of
  the values' scale, so the bound is rtol = atol = 1e-4. A capture that reads the wrong layers (one off)
  changes the states by O(1) and fails both checks.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.hidden_states.reader import DumpReader
from pipeline.target import load_target
from pipeline.train import run as train_run
from pipeline.train.data import collate
from pipeline.train.loop import build_objective
from pipeline.train.metrics import read_metrics
from pipeline.train.online import OnlineRows
from tests.support.tiny_runs import (
    EXPERIMENT,
    build_tiny_dump,
    online_cli,
    online_config,
    overrides,
    run_cli,
    train_losses,
)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory, tiny_model_dir, shared_data):
    """Two dumps of the same 12 conversations: rows forwarded alone, and in padded batches."""
    alone = build_tiny_dump(tmp_path_factory.mktemp("alone"), tiny_model_dir, shared_data, rows=12,
                            max_batch_size=1)
    batched = build_tiny_dump(tmp_path_factory.mktemp("batched"), tiny_model_dir, shared_data, rows=12)
    return alone, batched


def rows_and_reader(root: Path, model_dir: Path, shared_data: Path):
    cfg = online_config(root, model_dir, shared_data)
    target = load_target(cfg.target)
    rows = OnlineRows.from_config(cfg, target)
    return cfg, target, rows, DumpReader(cfg.stage_dir("dump"))


def loss_and_grads(cfg, target, source, indices):
    head, _ = train_run.build_head(cfg, target, source, list(range(len(source))), source.layer_ids)
    objective = build_objective(head, cfg.head, target.model.get_output_embeddings().weight)
    batch = collate(source, indices, cfg.train.max_length, with_aux=True)
    out = objective(input_ids=batch.input_ids, loss_mask=batch.loss_mask, attention_mask=batch.attention_mask,
                    aux_hidden=batch.aux_hidden, final_hidden=batch.final_hidden)
    out["loss"].backward()
    grads = {n: p.grad.clone() for n, p in objective.head.named_parameters() if p.grad is not None}
    return batch, out["loss"].detach(), grads


def off_by_one(rows: OnlineRows) -> OnlineRows:
    """A broken capture: each layer's successor read (a layer-numbering bug)."""
    return OnlineRows(rows.target, rows.samples, [i + 1 for i in rows.layer_ids])


def test_the_rows_and_their_order_are_the_dump_s(dumps, tiny_model_dir, shared_data):
    _, _, rows, reader = rows_and_reader(dumps[1], tiny_model_dir, shared_data)
    assert len(rows) == len(reader) and rows.lengths == list(reader.lengths)
    assert rows.layer_ids == reader.layer_ids and rows.num_tokens == reader.num_tokens
    for i in range(len(rows)):
        assert torch.equal(rows[i].input_ids, reader[i].input_ids)
        assert torch.equal(rows[i].loss_mask, reader[i].loss_mask)


def test_one_row_micro_batches_give_bitwise_equal_states_loss_and_gradients(dumps, tiny_model_dir, shared_data):
    cfg, target, rows, reader = rows_and_reader(dumps[0], tiny_model_dir, shared_data)
    for i in (0, 5):
        b_off, loss_off, g_off = loss_and_grads(cfg, target, reader, [i])
        b_on, loss_on, g_on = loss_and_grads(cfg, target, rows, [i])
        assert torch.equal(b_on.aux_hidden, b_off.aux_hidden) and torch.equal(b_on.final_hidden, b_off.final_hidden)
        assert torch.equal(loss_on, loss_off)
        assert g_on.keys() == g_off.keys() and all(torch.equal(g_on[n], g_off[n]) for n in g_on)
    _, loss_broken, _ = loss_and_grads(cfg, target, off_by_one(rows), [0])
    assert not torch.allclose(loss_broken, loss_and_grads(cfg, target, reader, [0])[1], rtol=1e-4, atol=1e-4)


def test_packed_micro_batches_agree_within_the_fp32_bound(dumps, tiny_model_dir, shared_data):
    cfg, target, rows, reader = rows_and_reader(dumps[1], tiny_model_dir, shared_data)
    indices = [3, 7, 1, 10]  # rows the dump forwarded in other batches, padded to other widths
    b_off, loss_off, g_off = loss_and_grads(cfg, target, reader, indices)
    b_on, loss_on, g_on = loss_and_grads(cfg, target, rows, indices)
    assert torch.equal(b_on.attention_mask, b_off.attention_mask) and torch.equal(b_on.loss_mask, b_off.loss_mask)
    torch.testing.assert_close(b_on.aux_hidden, b_off.aux_hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-4, atol=1e-4)
    for n in g_on:
        torch.testing.assert_close(g_on[n], g_off[n], rtol=1e-4, atol=1e-4 * float(g_off[n].abs().max()))
    b_broken, loss_broken, _ = loss_and_grads(cfg, target, off_by_one(rows), indices)
    assert not torch.allclose(b_broken.aux_hidden, b_off.aux_hidden, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(loss_broken, loss_off, rtol=1e-4, atol=1e-4)


def test_online_stage_trains_without_a_dump_and_refuses_to_resume_from_one(dumps, tiny_model_dir, shared_data,
                                                                           tmp_path):
    cfg = online_config(tmp_path, tiny_model_dir, shared_data, max_steps=4, save_every=2, plot=False,
                        val_fraction=0.25)
    cfg.train.source = "online"
    metrics = train_run.main(cfg)
    assert metrics["val/loss"] == metrics["val/loss"]  # finite: a real validation ran on online states
    train_dir = cfg.stage_dir("train")
    manifest = json.loads((train_dir / "manifest.json").read_text())
    assert manifest["source"] == "online" and manifest["counts"]["steps"] == 4
    assert not cfg.stage_dir("dump").exists()
    assert [r["step"] for r in read_metrics(train_dir / "metrics.jsonl") if "train/loss" in r][-1] == 4

    shutil.copytree(dumps[1] / EXPERIMENT / "dump", cfg.stage_dir("dump"))  # the same rows, dumped
    offline = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, source="dump", max_steps=6))
    with pytest.raises(RuntimeError, match="started with train.source=online and cannot resume with "
                                           "train.source=dump"):
        train_run.main(offline)


def test_online_kill9_then_rerun_reproduces_the_uninterrupted_losses(tmp_path, tiny_model_dir, shared_data):
    """Resume online as offline: the data position and RNG come from the checkpoint, the states are recomputed."""
    runs = {}
    for name, fault in (("ref", None), ("killed", "step_logged:6:SIGKILL")):
        d = {**overrides(tmp_path, tiny_model_dir, "eagle3", name, max_steps=8, save_every=4, eval_every=0,
                         tau_prompts=0), **online_cli(shared_data)}
        out = run_cli(d, fault=fault)
        assert out.returncode == (-9 if fault else 0), out.stderr[-2000:]
        runs[name] = (d, tmp_path / EXPERIMENT / "train" / name)
    d, killed = runs["killed"]
    assert max(train_losses(killed)) == 6 and not (killed / "manifest.json").exists()
    out = run_cli(d)  # the rerun resumes from step 4
    assert out.returncode == 0, out.stderr[-2000:]
    ref, got = train_losses(runs["ref"][1]), train_losses(killed)
    assert sorted(got) == sorted(ref) == list(range(1, 9))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-6, rel=0), step
