"""Interruptions of stage train: kill -9 (after a step, and inside a checkpoint write) then rerun resumes from
the last complete checkpoint and repeats the uninterrupted run's per-step losses (1e-6: same code, same
threads, same order of operations, so CPU results are in fact bitwise equal); SIGTERM checkpoints and exits
with REQUEUE_EXIT_CODE.

The interrupted runs are real `python -m pipeline.run` processes, started through tests/support/faulty_run.py: a
trainer hook makes them SIGKILL or SIGTERM themselves at a chosen point, so the interruption is deterministic."""
from __future__ import annotations

import json
import re

import pytest

from pipeline.manifest import TrainManifest
from pipeline.train import checkpoint as ckpt
from pipeline.train.loop import LrSchedule, ResumeRefused
from pipeline.train.metrics import read_metrics
from pipeline.train.run import main
from tests.support.tiny_runs import EXPERIMENT, as_config, overrides, run_cli, train_losses

# 2 epochs of 7 steps, checkpoints every 4: resume points fall mid-epoch (step 4) and across the epoch edge.
STEPS = 14


@pytest.fixture(scope="module")
def reference(dump_root, tiny_model_dir):
    """Per-step losses of the uninterrupted run, per head kind."""
    out = {}
    for kind in ("eagle3", "eagle1"):
        main(as_config(overrides(dump_root, tiny_model_dir, kind, f"ref-{kind}", tau_prompts=0)))
        out[kind] = train_losses(dump_root / EXPERIMENT / "train" / f"ref-{kind}")
        assert sorted(out[kind]) == list(range(1, STEPS + 1))
    return out


@pytest.mark.parametrize("kind, fault, resumed_from", [
    ("eagle3", "step_logged:10:SIGKILL", 8),  # after step 10 is logged (in epoch 1): steps 9-10 are redone
    # inside step 8's checkpoint write: the half-written one is ignored
    ("eagle1", "checkpoint_written:8:SIGKILL", 4),
])
def test_kill9_then_rerun_reproduces_the_uninterrupted_losses(dump_root, tiny_model_dir, reference, kind, fault,
                                                              resumed_from):
    d = overrides(dump_root, tiny_model_dir, kind, f"killed-{kind}", tau_prompts=0)
    train_dir = dump_root / EXPERIMENT / "train" / f"killed-{kind}"
    out = run_cli(d, fault=fault)
    assert out.returncode == -9, out.stderr[-2000:]
    killed_at = int(fault.split(":")[1])
    assert ckpt.latest_checkpoint(train_dir).name == f"step-{resumed_from}"
    assert max(train_losses(train_dir)) == killed_at  # the log ran ahead of the last checkpoint
    if fault.startswith("checkpoint_written"):
        assert (train_dir / "checkpoints" / f".step-{killed_at}.tmp").is_dir()

    main(as_config(d))  # the rerun

    losses = train_losses(train_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))  # log cut back to the checkpoint, then continued
    for step, loss in reference[kind].items():
        assert losses[step] == pytest.approx(loss, abs=1e-6, rel=0), step
    assert ckpt.latest_checkpoint(train_dir).name == f"step-{STEPS}"
    assert not list((train_dir / "checkpoints").glob(".*"))  # the torn write was replaced, not left behind


def test_sigterm_checkpoints_and_exits_with_the_requeue_code(dump_root, tiny_model_dir, reference):
    d = overrides(dump_root, tiny_model_dir, "eagle3", "term", tau_prompts=0)
    train_dir = dump_root / EXPERIMENT / "train" / "term"
    out = run_cli(d, fault="step_done:5:SIGTERM")  # as if the signal arrived during step 5
    assert out.returncode == ckpt.REQUEUE_EXIT_CODE == 75, out.stderr[-2000:]
    assert "exiting with 75" in out.stdout + out.stderr
    assert ckpt.latest_checkpoint(train_dir).name == "step-5"  # saved at the step boundary, off the schedule
    assert max(train_losses(train_dir)) == 5
    assert not (train_dir / "manifest.json").exists()  # not complete

    main(as_config(d))  # the requeued run
    losses = train_losses(train_dir)
    assert [losses[s] for s in sorted(losses)] == pytest.approx([reference["eagle3"][s] for s in sorted(losses)],
                                                                abs=1e-6, rel=0)
    assert (train_dir / "manifest.json").exists()
    assert all(r["step"] <= STEPS for r in read_metrics(train_dir / "metrics.jsonl"))


def tau_records(train_dir) -> dict[int, float]:
    return {r["step"]: r["eval/tau"] for r in read_metrics(train_dir / "metrics.jsonl") if "eval/tau" in r}


@pytest.mark.parametrize("fault, checkpoint", [("tau_decoding:8:SIGKILL", 8), ("step_done:4:SIGTERM", 4)])
def test_an_interrupted_real_tau_decode_is_redone_on_resume(dump_root, tiny_model_dir, fault, checkpoint):
    """The real-tau record of a checkpoint step survives a kill during its decode and a stop request at that
    step (which saves without decoding): the run resumed at that checkpoint decodes first."""
    ref = overrides(dump_root, tiny_model_dir, "eagle3", "tau-ref", max_steps=8)
    main(as_config(ref))
    expected = tau_records(dump_root / EXPERIMENT / "train" / "tau-ref")
    assert sorted(expected) == [4, 8]

    name = f"tau-{fault.split(':')[0]}"
    d = overrides(dump_root, tiny_model_dir, "eagle3", name, max_steps=8)
    out = run_cli(d, fault=fault)
    assert out.returncode in (-9, ckpt.REQUEUE_EXIT_CODE), out.stderr[-2000:]
    train_dir = dump_root / EXPERIMENT / "train" / name
    assert ckpt.latest_checkpoint(train_dir).name == f"step-{checkpoint}"
    main(as_config(d))
    assert tau_records(train_dir) == pytest.approx(expected, abs=1e-9)


# -- a resume that changes the lr schedule ------------------------------------------------------------------------


def lrs(train_dir) -> dict[int, float]:
    """The lr each logged step's update used (the scheduler's, as the optimizer's param groups hold it)."""
    return {r["step"]: r["lr"] for r in read_metrics(train_dir / "metrics.jsonl") if "lr" in r}


def test_a_changed_schedule_is_refused_by_default_and_applied_whole_when_asked(dump_root, tiny_model_dir):
    """The resumed LambdaLR keeps its checkpoint's base lr while its factor is the new run's, so a changed schedule
    would be mixed. By default the resume refuses, naming old and new values (lr, schedule kind, floor, and the
    total steps a longer run gives the cosine) and touching nothing; with train.on_schedule_change=apply the new
    schedule rules from the resumed step, its lr included, and the manifest records the change."""
    d = overrides(dump_root, tiny_model_dir, "eagle1", "sched", max_steps=4, tau_prompts=0, eval_every=0)
    main(as_config(d))  # cosine from lr 3e-3 (warmup 2) over 4 steps; checkpoint at step 4
    train_dir = dump_root / EXPERIMENT / "train" / "sched"
    before = (train_dir / "metrics.jsonl").read_text()
    for change, said in (({"lr": 1e-3}, "lr 0.003 -> 0.001"), ({"schedule": "linear"}, "schedule cosine -> linear"),
                         ({"min_lr_ratio": 0.1}, "min_lr_ratio 0.0 -> 0.1"), ({"max_steps": 8}, "total_steps 4 -> 8")):
        with pytest.raises(ResumeRefused, match=re.escape(said) + r"; the lr of step 5 goes from \S+ to \S+\)\. "
                                                r".*train\.on_schedule_change=apply"):
            main(as_config({**d, **{f"train.{k}": v for k, v in change.items()}}))
    assert (train_dir / "metrics.jsonl").read_text() == before
    assert [p.name for p in ckpt.checkpoint_dirs(train_dir)] == ["step-4"]

    new = {**d, "train.max_steps": 8, "train.lr": 1e-3, "train.schedule": "linear", "train.min_lr_ratio": 0.1,
           "train.on_schedule_change": "apply"}
    main(as_config(new))
    old_schedule, new_schedule = LrSchedule(3e-3, "cosine", 2, 0.0, 4), LrSchedule(1e-3, "linear", 2, 0.1, 8)
    got = lrs(train_dir)
    assert [got[s] for s in range(1, 5)] == pytest.approx([old_schedule.lr_at(s - 1) for s in range(1, 5)], rel=1e-12)
    # The resumed step's lr and every later one's are the new schedule's own, new lr included (mixed, step 5 would
    # be 3e-3 x the new factor).
    assert [got[s] for s in range(5, 9)] == pytest.approx([new_schedule.lr_at(s - 1) for s in range(5, 9)], rel=1e-12)
    change = {"step": 4, "from": old_schedule.to_dict(), "to": new_schedule.to_dict()}
    assert TrainManifest.load(train_dir).schedule_changes == [change]

    main(as_config(new))  # a rerun of the finished run: its checkpoint records the new schedule and the change
    assert TrainManifest.load(train_dir).schedule_changes == [change]


def test_a_checkpoint_without_a_recorded_schedule_resumes_as_before_and_a_constant_one_trains_longer(
        dump_root, tiny_model_dir, caplog):
    """A checkpoint of an older eaglet records no schedule: it resumes as before (its lr, this run's factor), with a
    warning. A constant schedule trained longer is the same schedule: no refusal."""
    d = overrides(dump_root, tiny_model_dir, "eagle1", "unrecorded", max_steps=2, tau_prompts=0, eval_every=0,
                  schedule="constant")
    main(as_config(d))
    train_dir = dump_root / EXPERIMENT / "train" / "unrecorded"
    main(as_config({**d, "train.max_steps": 4}))  # constant, longer: resumes
    assert lrs(train_dir) == pytest.approx({1: 1.5e-3, 2: 3e-3, 3: 3e-3, 4: 3e-3}, rel=1e-12)

    state_file = ckpt.latest_checkpoint(train_dir) / ckpt.TRAINER_STATE
    state = json.loads(state_file.read_text())
    for key in ("schedule", "schedule_changes"):  # as an older eaglet wrote it (the file holds the digests)
        del state[key]
    state_file.write_text(json.dumps(state))
    (train_dir / ckpt.RECORD).unlink()  # an older eaglet kept no record outside the checkpoint either
    with caplog.at_level("WARNING"):
        main(as_config({**d, "train.max_steps": 6, "train.lr": 1e-3}))
    assert "does not record its lr schedule" in caplog.text
    assert lrs(train_dir)[5] == pytest.approx(3e-3, rel=1e-12)  # its lr kept: as before
    assert TrainManifest.load(train_dir).schedule_changes == []
