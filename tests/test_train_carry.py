"""Carried runs (pipeline/train/carry.py): a run stopped on one machine continues on another that has none of its
checkpoints, from a small committed carry (bf16 weights, step, metrics, best/; no optimizer state).

What must hold: the continued run trains the remaining steps on the same data order from the carried weights (its
first loss matches the checkpoint-resumed run's to bf16 rounding, far from an untrained head's), the lr ramps again
from the carry, the manifest and later checkpoints record the carry, a finished run's carry gives back the same head
in bf16 without training, and a carry of another run or a damaged one is refused in one line."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline.files import sha256_file
from pipeline.hidden_states.plan import TokenizedSample
from pipeline.manifest import TrainManifest
from pipeline.train import checkpoint as ckpt
from pipeline.train.carry import CarryError, carry_bytes, head_path, read_carry, save_carry
from pipeline.train.loop import LrSchedule, ResumeRefused, StopForRequeue
from pipeline.train.metrics import read_metrics
from pipeline.train.online import OnlineRows
from pipeline.train.run import main
from tests.support.paths import REPO
from tests.support.tiny_runs import EXPERIMENT, as_config, overrides, train_losses

STEPS, STOP, WARMUP = 14, 6, 3  # 2 epochs of 7 steps; stopped after step 6 (off the save_every=4 schedule)


def stop_at(step: int):
    """A trainer hook: a stop request (SIGTERM) during `step`, as a session's end sends one."""
    def hook(event: str, at: int) -> None:
        if event == "step_done" and at == step:
            os.kill(os.getpid(), signal.SIGTERM)
    return hook


def carry_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.train.carry", *args], capture_output=True, text=True,
                          cwd=REPO)


def lrs(train_dir) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_metrics(train_dir / "metrics.jsonl") if "lr" in r}


@pytest.fixture(scope="module")
def stopped(dump_root, tiny_model_dir, tmp_path_factory):
    """Run "first" stopped after step 6 (checkpoint step-6, tau probe at 4 so best/ is step 4's head), its carry,
    and the same run resumed from its own checkpoint (the reference)."""
    d = overrides(dump_root, tiny_model_dir, "eagle3", "first", select="tau", carry_warmup_steps=WARMUP)
    with pytest.raises(StopForRequeue):
        main(as_config(d), hooks=(stop_at(STOP),))
    train_dir = dump_root / EXPERIMENT / "train" / "first"
    carry_dir = tmp_path_factory.mktemp("committed") / "first"
    record = save_carry(train_dir, carry_dir)
    # a budget the two heads exceed: the carry is best/'s checkpoint (step-4 is still kept), one head
    one_head_budget = record["files"]["model.safetensors"]["bytes"] * 3 // 2
    one_head = carry_dir.parent / "one_head"
    one_head_record = save_carry(train_dir, one_head, budget_bytes=one_head_budget)
    # ... and best/ further back than a carry may rewind: the step's head alone, best/'s left behind
    no_best = carry_dir.parent / "no_best"
    no_best_record = save_carry(train_dir, no_best, budget_bytes=one_head_budget, max_rewind_steps=1)
    weights = load_file(str(ckpt.latest_checkpoint(train_dir) / "model.safetensors"))
    main(as_config(d))  # the same machine: resumed from step-6 exactly
    return SimpleNamespace(overrides=d, train_dir=train_dir, carry=carry_dir, record=record, weights=weights,
                           one_head=one_head, one_head_record=one_head_record, no_best=no_best,
                           no_best_record=no_best_record)


def test_a_carry_holds_bf16_weights_metrics_and_best_and_no_optimizer(stopped):
    record = stopped.record
    assert record["step"] == STOP and record["total_steps"] == STEPS and record["best"]["step"] == 4
    assert not record["complete"]
    assert sorted(record["files"]) == ["best/head_config.json", "best/model.safetensors", "best/selected.json",
                                       "head_config.json", "metrics.jsonl.gz",
                                       "model.safetensors", "trainer_state.json"]
    assert not any(name.endswith(".pt") for name in os.listdir(stopped.carry))  # no pickles: no optimizer, no RNG
    weights = load_file(str(stopped.carry / "model.safetensors"))
    checkpoint = stopped.weights  # step-6's, fp32
    assert weights.keys() == checkpoint.keys()
    for name, t in weights.items():
        if checkpoint[name].is_floating_point():
            assert t.dtype == torch.bfloat16 and torch.equal(t, checkpoint[name].to(torch.bfloat16)), name
        else:  # d2t / t2d
            assert torch.equal(t, checkpoint[name]), name
    assert read_carry(stopped.carry)["step"] == STOP
    # a carry of the same state is the same bytes: committing it again changes nothing
    assert save_carry(stopped.train_dir, stopped.carry.parent / "again")["files"] == \
        save_carry(stopped.train_dir, stopped.carry.parent / "again2")["files"]


def test_a_fresh_machine_continues_a_carry(dump_root, tiny_model_dir, stopped):
    d = {**overrides(dump_root, tiny_model_dir, "eagle3", "carried", select="tau", carry_warmup_steps=WARMUP),
         "train.carry_from": str(stopped.carry)}
    main(as_config(d))
    train_dir = dump_root / EXPERIMENT / "train" / "carried"
    losses, reference = train_losses(train_dir), train_losses(stopped.train_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(losses[s] == reference[s] for s in range(1, STOP + 1))  # the carried curve
    # Step 7's loss is computed from the carried weights before any update: the exact resume's within bf16
    # rounding, while an untrained head is far off (step 1's loss).
    assert losses[STOP + 1] == pytest.approx(reference[STOP + 1], rel=0.02)
    assert abs(reference[1] - reference[STOP + 1]) > 10 * abs(losses[STOP + 1] - reference[STOP + 1])

    # The lr ramps again over WARMUP steps from the carry, then follows the run's schedule.
    state = json.loads((ckpt.latest_checkpoint(train_dir) / ckpt.TRAINER_STATE).read_text())
    schedule = LrSchedule.from_record(state["schedule"])
    assert schedule.restarts == ((STOP, WARMUP),)
    base, got = LrSchedule(3e-3, "cosine", 2, 0.0, STEPS), lrs(train_dir)
    for s in range(STOP + 1, STEPS + 1):
        ramp = min(1.0, (s - STOP) / WARMUP)
        assert got[s] == pytest.approx(ramp * base.lr_at(s - 1), rel=1e-12), s
    assert got[STOP + 1] == pytest.approx(lrs(stopped.train_dir)[STOP + 1] / WARMUP, rel=1e-12)

    manifest = TrainManifest.load(train_dir)
    assert [c["step"] for c in manifest.carries] == [STOP] and manifest.counts["steps"] == STEPS
    assert TrainManifest.load(stopped.train_dir).carries == []
    assert manifest.selected["step"] in (4, 8, 12, 14)  # the probes, step 4's from the carry

    # A rerun on this machine resumes from its own checkpoint: the restart is the run's history, not a change.
    main(as_config(d))
    assert TrainManifest.load(train_dir).carries == manifest.carries


def test_a_carry_over_its_budget_is_taken_at_the_best_heads_checkpoint(dump_root, tiny_model_dir, stopped):
    record = stopped.one_head_record
    assert (record["step"], record["checkpoint"], record["rewound_steps"]) == (4, "step-4", STOP - 4)
    assert record["best"]["step"] == 4 and not any(name.startswith("best/") for name in record["files"])
    assert carry_bytes(record) < carry_bytes(stopped.record) and carry_bytes(stopped.record) > \
        record["files"]["model.safetensors"]["bytes"] * 3 // 2
    out = carry_cli("check", str(stopped.one_head))
    assert out.returncode == 0 and "the 2 steps after it are trained again" in out.stdout, out.stderr
    d = {**overrides(dump_root, tiny_model_dir, "eagle3", "one_head", select="tau", carry_warmup_steps=WARMUP),
         "train.carry_from": str(stopped.one_head)}
    main(as_config(d))
    train_dir = dump_root / EXPERIMENT / "train" / "one_head"
    assert sorted(train_losses(train_dir)) == list(range(1, STEPS + 1))  # steps 5 and 6 trained again
    manifest = TrainManifest.load(train_dir)
    assert [c["step"] for c in manifest.carries] == [4] and manifest.counts["steps"] == STEPS
    # step 4's probe came with the carry, and best/ was rebuilt from the carried head: a selection among 4, 8, 12, 14
    assert [r["step"] for r in read_metrics(train_dir / "metrics.jsonl") if "eval/tau" in r] == [4, 8, 12, 14]
    assert manifest.selected["step"] in (4, 8, 12, 14)


def test_a_carry_over_its_budget_with_a_distant_best_leaves_that_head_behind(dump_root, tiny_model_dir, stopped):
    record = stopped.no_best_record
    assert (record["step"], record["checkpoint"], record["rewound_steps"]) == (STOP, f"step-{STOP}", 0)
    assert record["best"] is None and record["best_left_behind"]["step"] == 4 and "best head" in record["left_behind"]
    assert not any(name.startswith("best/") for name in record["files"])
    carried = load_file(str(stopped.no_best / "model.safetensors"))  # step 6's head, not step 4's
    assert all(torch.equal(t, stopped.weights[k].to(t.dtype)) for k, t in carried.items())
    out = carry_cli("check", str(stopped.no_best))
    assert out.returncode == 0 and "left behind: the run chooses among the probes after step 6" in out.stdout, \
        out.stderr
    d = {**overrides(dump_root, tiny_model_dir, "eagle3", "no_best", select="tau", carry_warmup_steps=WARMUP),
         "train.carry_from": str(stopped.no_best)}
    main(as_config(d))
    train_dir = dump_root / EXPERIMENT / "train" / "no_best"
    assert sorted(train_losses(train_dir)) == list(range(1, STEPS + 1))  # nothing trained again
    # step 4's probe stays in the curves, but final/ is chosen among the heads this run has: 8, 12, 14
    probes = {r["step"]: r["eval/tau"] for r in read_metrics(train_dir / "metrics.jsonl") if "eval/tau" in r}
    assert sorted(probes) == [4, 8, 12, 14]
    manifest = TrainManifest.load(train_dir)
    assert manifest.carries[0]["best_left_behind"]["step"] == 4
    after = {s: t for s, t in probes.items() if s > STOP}
    assert manifest.selected["step"] == min(s for s, t in after.items() if t == max(after.values()))
    best = json.loads((train_dir / ckpt.BEST / ckpt.SELECTED).read_text())
    assert best == {"step": manifest.selected["step"], "tau": after[manifest.selected["step"]]}


def test_a_finished_runs_carry_gives_back_its_head_without_training(dump_root, tiny_model_dir, stopped):
    finished = stopped.carry.parent / "finished"
    record = save_carry(stopped.train_dir, finished)
    assert record["complete"]
    # one head, the one final/ is: here the best-tau probe's, not the last step's (the two differ in this run)
    selected = TrainManifest.load(stopped.train_dir).selected
    assert selected["step"] != STEPS and record["best"]["step"] == selected["step"]
    assert [name for name in record["files"] if name.endswith("model.safetensors")] == ["best/model.safetensors"]
    assert carry_cli("check", "--complete", str(finished)).returncode == 0
    assert carry_cli("check", "--complete", str(stopped.carry)).returncode == 1
    d = {**overrides(dump_root, tiny_model_dir, "eagle3", "rebuilt", select="tau"), "train.carry_from": str(finished)}
    main(as_config(d))
    train_dir = dump_root / EXPERIMENT / "train" / "rebuilt"
    assert train_losses(train_dir) == train_losses(stopped.train_dir)  # nothing trained, the curves carried
    ours, theirs = (load_file(str(t / "final" / "model.safetensors")) for t in (train_dir, stopped.train_dir))
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        as_evaluated = torch.bfloat16 if t.is_floating_point() else t.dtype  # eval runs the head in bf16
        assert torch.equal(ours[name].to(as_evaluated), t.to(as_evaluated)), name
    assert TrainManifest.load(train_dir).selected["step"] == TrainManifest.load(stopped.train_dir).selected["step"]
    # no restart (nothing trains), and the manifest names the run it was carried from: its evals count for this head
    [carried] = TrainManifest.load(train_dir).carries
    assert carried["complete"] and carried["train_manifest_sha256"] == sha256_file(stopped.train_dir / "manifest.json")
    # and the machine the carried run trained on (its model card's "trained on"; this machine trained nothing)
    assert record["machine"] == carried["machine"] == TrainManifest.load(stopped.train_dir).machine is not None
    state = json.loads((ckpt.latest_checkpoint(train_dir) / ckpt.TRAINER_STATE).read_text())
    assert LrSchedule.from_record(state["schedule"]).restarts == ()
    # Carried again (a job's stop carries the row it is in): the same carry, byte for byte, never one that names
    # the rebuilding machine as the one that trained it; elsewhere a copy of it; gone, refused in one line.
    before = (finished / "carry.json").read_bytes()
    assert save_carry(train_dir, finished) == record and (finished / "carry.json").read_bytes() == before
    again = finished.parent / "carried_again"
    assert save_carry(train_dir, again) == record and (again / "carry.json").read_bytes() == before
    assert read_carry(again)["files"] == record["files"]
    shutil.rmtree(finished)
    with pytest.raises(CarryError, match=r"rebuilt from the complete carry .*finished.*: check it out from git"):
        save_carry(train_dir, finished.parent / "third")


def test_a_carry_of_another_run_or_a_damaged_one_is_refused(dump_root, tiny_model_dir, stopped, tmp_path):
    other = {**overrides(dump_root, tiny_model_dir, "eagle3", "other", train_fraction=0.5),  # other rows
             "train.carry_from": str(stopped.carry)}
    with pytest.raises(ResumeRefused, match="portable_identity=.*'train_rows': 35"):
        main(as_config(other))
    reordered = {**overrides(dump_root, tiny_model_dir, "eagle3", "reordered", seed=1),
                 "train.carry_from": str(stopped.carry)}
    with pytest.raises(ResumeRefused):
        main(as_config(reordered))

    damaged = tmp_path / "damaged"
    save_carry(stopped.train_dir, damaged)
    weights = head_path(damaged) / "model.safetensors"  # (the run is complete by now: its best/ head)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CarryError, match=r"model\.safetensors: sha256 .* \(corrupt\)"):
        read_carry(damaged)
    out = carry_cli("check", str(damaged))  # one line, naming the carry, the file and the reason
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "(corrupt)" in out.stderr, out.stderr
    with pytest.raises(CarryError, match="no carry.json"):
        read_carry(tmp_path / "nothing")


def test_the_online_rows_digest_is_their_content():
    """The carry's stand-in for the regen manifest's digest (which another machine's restore rewrites)."""
    target = SimpleNamespace(num_layers=30)
    rows = [TokenizedSample(f"r{i}", np.arange(5 + i, dtype=np.int32), np.ones(5 + i, dtype=np.uint8))
            for i in range(3)]
    digest = OnlineRows(target, rows, None).digest()
    assert OnlineRows(target, [TokenizedSample(r.id, r.input_ids.copy(), r.loss_mask.copy()) for r in rows],
                      None).digest() == digest
    masked = [*rows[:2], TokenizedSample("r2", rows[2].input_ids, np.zeros(7, dtype=np.uint8))]
    assert OnlineRows(target, masked, None).digest() != digest
