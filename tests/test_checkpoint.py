"""Checkpoints (pipeline/train/checkpoint.py): the record of their digests kept outside them, which a resume checks
every file against before anything loads (DeepSpeed's files load by unpickling, which runs code), and the
background write (train.async_save).

DeepSpeed needs CUDA, so its engine is stood in for by `OneRank(deepspeed=True)`: it saves a pickle under the
checkpoint's deepspeed/ folder and loads it as DeepSpeed does (torch.load, weights_only=False), so a pickle that
got past the check would run. The runs of the stage are real (the tiny dump of tests/support/tiny_runs.py), killed and
stopped through tests/support/faulty_run.py as in test_train_resume.py."""
from __future__ import annotations

import errno
import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.heads import DraftHeadConfig, build_draft_head
from pipeline.manifest import ManifestError, check_files, disk_full, file_digests
from pipeline.train import checkpoint as ckpt
from pipeline.train.parallel import DS_TAG
from pipeline.train.run import main
from tests.support.holder import Holder
from tests.support.tiny_runs import EXPERIMENT, as_config, overrides, run_cli, train_losses

pytestmark = pytest.mark.usefixtures("single_thread")

STEPS = 14  # 2 epochs of 7 steps, checkpoints every 4 (tests/support/tiny_runs.py BASE_TRAIN)
DS_FILE = f"{DS_TAG}/mp_rank_00_model_states.pt"


# ---------------------------------------------------------------------------------------------------------
# the checkpoint functions, on one rank


class OneRank:
    """What the checkpoint functions call of pipeline/train/parallel.Parallel, for one process. With `deepspeed`,
    the engine's part as DeepSpeed does it: a pickle per rank under deepspeed/, loaded with weights_only=False."""

    rank, world_size, is_main = 0, 1, True

    def __init__(self, deepspeed: bool = False):
        self.deepspeed = deepspeed
        self.engine_loads = 0

    def barrier(self) -> None:
        pass

    def any(self, flag: bool) -> bool:
        return bool(flag)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def save_engine_state(self, model: nn.Module, directory: Path) -> None:
        if self.deepspeed:
            (directory / DS_TAG).mkdir()
            torch.save({"module": model.head.state_dict()}, directory / DS_FILE)

    def load_engine_state(self, model: nn.Module, directory: Path) -> None:
        self.engine_loads += 1
        for path in sorted((directory / DS_TAG).glob("*.pt")):
            torch.load(path, weights_only=False)


class Payload:
    """A pickle that runs code when loaded: it creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def training_state(tiny_model, seed: int = 0):
    """A tiny EAGLE-1 head one AdamW step in: (model, optimizer, scheduler)."""
    torch.manual_seed(seed)
    head = build_draft_head(DraftHeadConfig.from_target(tiny_model.config, "eagle1", None, None))
    head.copy_from_target(tiny_model)
    model = Holder(head)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    sum(p.sum() for p in head.parameters() if p.requires_grad).backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def state(step: int) -> dict:
    return {"step": step}


def head_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.head.state_dict().items()}


def test_a_deepspeed_file_changed_with_its_list_is_refused_before_anything_loads(tmp_path, tiny_model):
    par = OneRank(deepspeed=True)
    model, optimizer, scheduler = training_state(tiny_model)
    path = ckpt.CheckpointWriter(tmp_path, par, keep=2).save(model, optimizer, scheduler, state(4))
    assert path == ckpt.latest_checkpoint(tmp_path)
    assert set(ckpt.read_record(tmp_path)) == {"step-4"}
    ckpt.load_checkpoint(path, par, *training_state(tiny_model, seed=1))  # intact: resumes
    assert par.engine_loads == 1

    # The attack: the engine's pickle replaced by one that runs code, and the checkpoint's own list rewritten.
    marker = tmp_path / "code-ran"
    torch.save(Payload(marker), path / DS_FILE)
    trainer_state = json.loads((path / ckpt.TRAINER_STATE).read_text())
    trainer_state["files"] = file_digests(path, [n for n in trainer_state["files"]])
    (path / ckpt.TRAINER_STATE).write_text(json.dumps(trainer_state))
    check_files(path, trainer_state["files"], "checkpoint", "")  # the in-folder list alone is fooled

    fresh = training_state(tiny_model, seed=1)
    before = head_weights(fresh[0])
    with pytest.raises(ckpt.CheckpointRefused, match=rf"step-4: {DS_FILE}: .* recorded .*checkpoints\.json"):
        ckpt.load_checkpoint(path, par, *fresh)
    assert par.engine_loads == 1 and not marker.exists()
    assert all(torch.equal(before[k], v) for k, v in fresh[0].head.state_dict().items())  # nothing loaded

    # Unchecked: refused, saying why and what to do.
    with pytest.raises(ckpt.CheckpointRefused, match=r"unpickling .* runs whatever code .*verify_inputs=true"):
        ckpt.load_checkpoint(path, par, *fresh, verify=False)
    assert par.engine_loads == 1 and not marker.exists()


def test_files_added_to_a_checkpoint_or_a_missing_record_are_refused(tmp_path, tiny_model):
    par = OneRank(deepspeed=True)
    path = ckpt.CheckpointWriter(tmp_path, par, keep=2).save(*training_state(tiny_model), state(4))
    extra = path / DS_TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"  # DeepSpeed globs for these
    torch.save(Payload(tmp_path / "code-ran"), extra)
    with pytest.raises(ckpt.CheckpointRefused, match=rf"{extra.relative_to(path)}: not written by this run"):
        ckpt.load_checkpoint(path, par, *training_state(tiny_model))
    extra.unlink()

    (tmp_path / ckpt.RECORD).unlink()  # copied in from elsewhere, or written before the record existed
    with pytest.raises(ckpt.CheckpointRefused, match=r"step-4 is not in .*checkpoints\.json.*unpickling"):
        ckpt.load_checkpoint(path, par, *training_state(tiny_model))
    assert par.engine_loads == 0 and not (tmp_path / "code-ran").exists()


def test_a_symlink_in_a_checkpoint_is_refused(tmp_path, tiny_model):
    """A linked folder hides its files from the check (os.walk and rglob do not descend into it), and DeepSpeed
    globs its partitions there: an extra pickle behind the link would load unchecked."""
    par = OneRank(deepspeed=True)
    path = ckpt.CheckpointWriter(tmp_path / "run", par, keep=2).save(*training_state(tiny_model), state(4))
    elsewhere = tmp_path / "elsewhere"
    (path / DS_TAG).rename(elsewhere)
    torch.save(Payload(tmp_path / "code-ran"), elsewhere / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    (path / DS_TAG).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ckpt.CheckpointRefused, match=rf"{DS_TAG} is a symbolic link"):
        ckpt.load_checkpoint(path, par, *training_state(tiny_model))
    assert par.engine_loads == 0 and not (tmp_path / "code-ran").exists()


def test_an_unrecorded_deepspeed_checkpoint_is_adopted_only_when_its_own_list_holds(tmp_path, tiny_model):
    """An older eaglet's DeepSpeed checkpoint has no record entry: refused on resume, naming `adopt`, which
    records it after checking it against its own list (and refuses a file beyond that list)."""
    par = OneRank(deepspeed=True)
    path = ckpt.CheckpointWriter(tmp_path, par, keep=2).save(*training_state(tiny_model), state(4))
    (tmp_path / ckpt.RECORD).unlink()
    with pytest.raises(ckpt.CheckpointRefused, match=rf"python -m pipeline.train.checkpoint adopt {path}"):
        ckpt.load_checkpoint(path, par, *training_state(tiny_model))
    extra = path / DS_TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save(Payload(tmp_path / "code-ran"), extra)
    with pytest.raises(ckpt.CheckpointRefused, match=r"zero_pp_rank_1_.* not in its own list"):
        ckpt.main(["adopt", str(path)])
    extra.unlink()
    torch.save(Payload(tmp_path / "code-ran"), path / DS_FILE)  # a changed file: its own list says otherwise
    with pytest.raises(ManifestError, match=rf"{DS_FILE}: .*cannot be adopted"):
        ckpt.adopt(path)
    assert not (tmp_path / ckpt.RECORD).exists()

    fresh = tmp_path / "fresh"  # an intact one is adopted, then resumes
    path = ckpt.CheckpointWriter(fresh, par, keep=2).save(*training_state(tiny_model), state(4))
    (fresh / ckpt.RECORD).unlink()
    ckpt.main(["adopt", str(path)])
    assert ckpt.read_record(fresh)["step-4"] == file_digests(path)
    ckpt.load_checkpoint(path, par, *training_state(tiny_model, seed=1))
    assert par.engine_loads == 1 and not (tmp_path / "code-ran").exists()


def test_the_record_follows_the_kept_checkpoints(tmp_path, tiny_model):
    par = OneRank()
    stale = tmp_path / f".{ckpt.RECORD}.99999.tmp"  # what a kill inside the record's write leaves
    stale.write_text("{")
    writer = ckpt.CheckpointWriter(tmp_path, par, keep=2)
    assert not stale.exists()
    model, optimizer, scheduler = training_state(tiny_model)
    for step in (2, 4, 6):
        writer.save(model, optimizer, scheduler, state(step))
    kept = [p.name for p in ckpt.checkpoint_dirs(tmp_path)]
    assert kept == ["step-4", "step-6"] and sorted(ckpt.read_record(tmp_path)) == kept
    for name, files in ckpt.read_record(tmp_path).items():
        assert files == file_digests(tmp_path / ckpt.CHECKPOINTS / name)  # every file, the state file too


def test_a_failed_background_write_is_raised_at_the_next_wait_naming_the_checkpoint(tmp_path, tiny_model,
                                                                                      monkeypatch):
    writer = ckpt.CheckpointWriter(tmp_path, OneRank(), keep=2, background=True)
    model, optimizer, scheduler = training_state(tiny_model)
    real_write = ckpt.write_head

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "write_head", full_disk)
    writer.save(model, optimizer, scheduler, state(4))  # returns: the write fails in the background
    monkeypatch.setattr(ckpt, "write_head", real_write)
    with pytest.raises(ckpt.CheckpointWriteError, match=r"checkpoint .*step-4: the background write failed: OSError"
                                                        r".*No space left") as e:
        writer.save(model, optimizer, scheduler, state(8))  # the next save waits first
    assert disk_full(e.value)  # the cause stays in the chain (the CLI's one-line full-disk message)
    root = tmp_path / ckpt.CHECKPOINTS
    assert list(root.iterdir()) == [] and ckpt.read_record(tmp_path) == {}  # nothing torn, nothing recorded
    writer.save(model, optimizer, scheduler, state(8))
    assert writer.wait() == root / "step-8" and set(ckpt.read_record(tmp_path)) == {"step-8"}


def test_a_waiting_save_waits_for_the_pending_background_write(tmp_path, tiny_model):
    """What a stop request's save does (Trainer.save(wait=True)): it returns only once the write before it and its
    own are in place."""
    writer = ckpt.CheckpointWriter(tmp_path, OneRank(), keep=2, background=True)
    model, optimizer, scheduler = training_state(tiny_model)
    release = threading.Event()
    writer.save(model, optimizer, scheduler, state(4),
                announce=lambda event: event == "checkpoint_written" and release.wait())
    stop_save = threading.Thread(target=writer.save, args=(model, optimizer, scheduler, state(5)),
                                 kwargs={"wait": True})
    stop_save.start()
    time.sleep(0.5)
    assert stop_save.is_alive() and ckpt.latest_checkpoint(tmp_path) is None  # step 4 is still being written
    release.set()
    stop_save.join(30)
    assert not stop_save.is_alive()
    assert [p.name for p in ckpt.checkpoint_dirs(tmp_path)] == ["step-4", "step-5"]
    assert sorted(ckpt.read_record(tmp_path)) == ["step-4", "step-5"]


# ---------------------------------------------------------------------------------------------------------
# real runs of the stage


@pytest.fixture(scope="module")
def reference(dump_root, tiny_model_dir) -> Path:
    """The uninterrupted run, checkpoints written synchronously (the default)."""
    main(as_config(overrides(dump_root, tiny_model_dir, "eagle3", "ref", tau_prompts=0)))
    return dump_root / EXPERIMENT / "train" / "ref"


def assert_same_run(train_dir: Path, reference: Path) -> None:
    """The run's per-step losses are the uninterrupted run's (1e-6; in fact bitwise on CPU), and every checkpoint
    it keeps is recorded with the digests of its files."""
    losses, expected = train_losses(train_dir), train_losses(reference)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in expected.items():
        assert losses[step] == pytest.approx(loss, abs=1e-6, rel=0), step
    record = ckpt.read_record(train_dir)
    assert sorted(record) == [p.name for p in ckpt.checkpoint_dirs(train_dir)]
    for name, files in record.items():
        assert files == file_digests(train_dir / ckpt.CHECKPOINTS / name)


def test_async_save_writes_the_sync_checkpoints_byte_for_byte(dump_root, tiny_model_dir, reference):
    main(as_config(overrides(dump_root, tiny_model_dir, "eagle3", "async", tau_prompts=0, async_save=True)))
    train_dir = dump_root / EXPERIMENT / "train" / "async"
    assert_same_run(train_dir, reference)
    assert ckpt.read_record(train_dir) == ckpt.read_record(reference)  # every file of step 12 and 14, same sha256


def test_a_kill_between_the_record_and_the_rename_resumes_from_the_checkpoint_before(dump_root, tiny_model_dir,
                                                                                      reference):
    d = overrides(dump_root, tiny_model_dir, "eagle3", "recorded", tau_prompts=0)
    train_dir = dump_root / EXPERIMENT / "train" / "recorded"
    out = run_cli(d, fault="checkpoint_recorded:8:SIGKILL")
    assert out.returncode == -9, out.stderr[-2000:]
    # step 8 is recorded but still in its temporary folder: the record names a folder that does not exist
    assert ckpt.latest_checkpoint(train_dir).name == "step-4"
    assert sorted(ckpt.read_record(train_dir)) == ["step-4", "step-8"]
    main(as_config(d))
    assert_same_run(train_dir, reference)


@pytest.mark.parametrize("fault, latest, code", [
    # The kill comes from the writer's thread while the loop has moved on: step 8 never took its name.
    ("checkpoint_written:8:SIGKILL", "step-4", -9),
    # A stop request at step 5 writes step 5 and waits for it (and for step 4's write) before exiting with 75.
    ("step_done:5:SIGTERM", "step-5", ckpt.REQUEUE_EXIT_CODE),
])
def test_async_runs_killed_or_stopped_resume_to_the_same_losses(dump_root, tiny_model_dir, reference, fault, latest,
                                                                 code):
    name = f"async-{fault.split(':')[0]}"
    d = overrides(dump_root, tiny_model_dir, "eagle3", name, tau_prompts=0, async_save=True)
    train_dir = dump_root / EXPERIMENT / "train" / name
    out = run_cli(d, fault=fault)
    assert out.returncode == code, out.stderr[-2000:]
    assert ckpt.latest_checkpoint(train_dir).name == latest
    record = ckpt.read_record(train_dir)
    assert record[latest] == file_digests(train_dir / ckpt.CHECKPOINTS / latest)  # whole and recorded
    main(as_config(d))
    assert_same_run(train_dir, reference)


@pytest.mark.cluster
def test_two_processes_write_in_the_background_and_record_every_ranks_files(dump_root, tiny_model_dir):
    """DDP over 2 processes with train.async_save: only the main rank has a writer thread, and every rank meets it
    at the same waits (a rank that missed one would hang the all-reduce); the losses are one process's with the
    same global batch (tests/test_train_ddp.py: 1e-5)."""
    common = dict(max_steps=8, epochs=3, tau_prompts=0, async_save=True)
    one = overrides(dump_root, tiny_model_dir, "eagle3", "one", grad_accum=2, **common)
    main(as_config(one))
    two = overrides(dump_root, tiny_model_dir, "eagle3", "two", grad_accum=1, **common)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = run_cli(two, env={"OMP_NUM_THREADS": "1"}, launcher=torchrun, timeout=180)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    ref, got = (train_losses(dump_root / EXPERIMENT / "train" / n) for n in ("one", "two"))
    assert sorted(got) == sorted(ref) == list(range(1, 9))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=1e-5), step
    train_dir = dump_root / EXPERIMENT / "train" / "two"
    record = ckpt.read_record(train_dir)
    assert sorted(record) == ["step-4", "step-8"]
    for name, files in record.items():
        assert {"rng-rank0.pt", "rng-rank1.pt"} <= set(files)
        assert files == file_digests(train_dir / ckpt.CHECKPOINTS / name)
