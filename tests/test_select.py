"""train.select=tau (pipeline/train/loop.py): the checkpoint with the best decoded tau becomes final/, not the
last one (tau can turn down while the loss still falls), and train.patience stops the run after that many tau
probes without a gain; a rerun of the stopped run trains no further. The probe's taus are scripted here, so the
choice is known; each probe's head is copied to check that final/ is that step's."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.heads.io import head_state
from pipeline.train.config import TrainConfig
from pipeline.train.loop import TauProbe
from pipeline.train.run import main
from tests.support.tiny_runs import as_config, overrides

TAUS = [1.1, 1.3, 1.2, 1.25, 1.5, 1.6, 1.7]  # best at the 2nd probe; patience 2 stops at the 4th


def test_the_best_tau_checkpoint_becomes_final_and_patience_stops_the_run(dump_root, tiny_model_dir,
                                                                          monkeypatch):
    probes = []

    def scripted(self, head):
        probes.append(head_state(head))
        return {"eval/tau": TAUS[len(probes) - 1], "eval/decode_s": 0.0}

    monkeypatch.setattr(TauProbe, "__call__", scripted)
    d = overrides(dump_root, tiny_model_dir, "eagle3", "select", save_every=2, tau_prompts=1, select="tau",
                  patience=2)
    cfg = as_config(d)
    main(cfg)
    train_dir = cfg.stage_dir("train")
    manifest = json.loads((train_dir / "manifest.json").read_text())
    assert len(probes) == 4 and manifest["counts"]["steps"] == 8  # probes at steps 2, 4, 6, 8; 14 planned
    assert manifest["selected"] == {"step": 4, "tau": 1.3, "last_step": 8}
    final = load_file(str(train_dir / "final" / "model.safetensors"))
    assert final.keys() == probes[1].keys() and all(torch.equal(final[k], probes[1][k]) for k in final)
    assert not all(torch.equal(final[k], probes[3][k]) for k in final)  # not the last head
    main(cfg)  # the rerun: patience was spent, nothing more is trained or decoded
    assert len(probes) == 4 and json.loads((train_dir / "manifest.json").read_text())["counts"]["steps"] == 8


def test_select_tau_needs_the_probe_and_patience_needs_select_tau():
    with pytest.raises(ValueError, match="needs train.tau_prompts >= 1"):
        TrainConfig(select="tau", tau_prompts=0)
    with pytest.raises(ValueError, match="needs train.select=tau"):
        TrainConfig(patience=2)


def test_with_async_saves_best_never_runs_ahead_of_the_checkpoints(dump_root, tiny_model_dir,
                                                                    monkeypatch):
    """train.async_save writes a checkpoint while the loop goes on: a kill before step N's write is in place
    resumes before N, so best/ must not hold step N's head by then. A slow disk is stood in for by a hook that
    holds the writer's thread after the files are written: best/ must still be an earlier step's meanwhile."""
    import time

    taus = iter([1.1, 1.3, 1.5, 1.7])  # every probe is the best so far
    monkeypatch.setattr(TauProbe, "__call__", lambda self, head: {"eval/tau": next(taus), "eval/decode_s": 0.0})
    d = overrides(dump_root, tiny_model_dir, "eagle3", "select-async", save_every=2, max_steps=8, tau_prompts=1,
                  select="tau", async_save=True)
    cfg = as_config(d)
    best = cfg.stage_dir("train") / "best" / "selected.json"
    seen = {}

    def slow_disk(event, step):
        if event == "checkpoint_written":
            time.sleep(0.5)  # the loop meanwhile decodes step N's tau (scripted: at once) and would keep best/
            seen[step] = json.loads(best.read_text())["step"] if best.exists() else None

    main(cfg, hooks=[slow_disk])
    assert sorted(seen) == [2, 4, 6, 8]
    assert all(kept is None or kept < step for step, kept in seen.items()), seen
    assert json.loads(best.read_text())["step"] == 8
