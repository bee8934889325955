"""Checkpoints of the train stage.

    <train dir>/checkpoints/step-N/   head (trainable weights + vocab maps), optimizer, scheduler, RNG states
                                      of every rank, trainer_state.json (step, data position); written to a
                                      temporary directory and renamed, so a step-N directory is always whole
    <train dir>/checkpoints.json      the record of the checkpoints this folder's runs wrote: every file's size
                                      and sha256, written before the rename; a resume checks against it
                                      (check_checkpoint), never against the checkpoint's own list
    <train dir>/final/                the trained head (pipeline/heads/io.py): what export and eval load"""
from __future__ import annotations

import copy
import functools
import json
import logging
import os
import random
import re
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

from pipeline.files import atomic_write_text, fsync_dir, fsync_file, replace_dir, stale_tmp_siblings
from pipeline.heads.io import head_state, load_head_weights, write_head
from pipeline.manifest import ManifestError, check_files, file_digests, file_problem

from .parallel import DS_TAG

log = logging.getLogger(__name__)

# sysexits.h EX_TEMPFAIL ("try again later"): the run was asked to stop (SIGTERM/SIGUSR1), saved a checkpoint
# and exited; scripts requeue on this code and the rerun resumes. Distinct from crashes (1) and signals (128+n).
REQUEUE_EXIT_CODE = 75

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
RECORD = "checkpoints.json"  # in the train folder, beside checkpoints/ (read_record)
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
BEST, SELECTED = "best", "selected.json"  # train.select=tau: the best head so far, and its {step, tau}
_STEP_DIR = re.compile(r"^step-(\d+)$")


# ---------------------------------------------------------------------------------------------------------
# RNG states


def rng_state() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        # numpy's legacy state as tensors/ints, so the file loads with weights_only=True.
        "numpy": _numpy_state_to_torch(np.random.get_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(_numpy_state_from_torch(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_state_to_torch(s: tuple) -> tuple:
    name, keys, pos, has_gauss, cached = s
    return name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def _numpy_state_from_torch(s: tuple) -> tuple:
    name, keys, pos, has_gauss, cached = s
    return name, keys.numpy().astype(np.uint32), pos, has_gauss, cached


# ---------------------------------------------------------------------------------------------------------
# training checkpoints


def checkpoint_dirs(train_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories of interrupted writes are ignored)."""
    root = Path(train_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))
             and (p / TRAINER_STATE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(train_dir: Path) -> Optional[Path]:
    dirs = checkpoint_dirs(train_dir)
    return dirs[-1] if dirs else None


def read_record(train_dir: Path) -> dict[str, dict]:
    """The train folder's record of the checkpoints its runs wrote: {"step-N": {file below it: {"bytes",
    "sha256"}}}. Kept outside the checkpoint folders, so changing a checkpoint's files (and the list in its
    trainer_state.json) does not change what it is checked against."""
    path = Path(train_dir) / RECORD
    return json.loads(path.read_text())["checkpoints"] if path.is_file() else {}


def _update_record(train_dir: Path, name: Optional[str] = None, files: Optional[dict] = None) -> None:
    """Rewrites the record with the entries of the checkpoint folders that exist, plus checkpoint `name`'s.
    A checkpoint is recorded before its folder takes its name and unrecorded after its folder is pruned, so a
    kill between two writes leaves at most an entry without a folder (harmless: the next write of that step
    replaces it), never a folder without its entry."""
    root = Path(train_dir) / CHECKPOINTS
    kept = {n: f for n, f in read_record(train_dir).items() if n != name and (root / n).is_dir()}
    if name is not None:
        kept[name] = files
    atomic_write_text(Path(train_dir) / RECORD, json.dumps({"checkpoints": kept}, indent=1) + "\n")
    fsync_dir(Path(train_dir))  # the record's rename is durable before the checkpoint's folder takes its name


def _remove_checkpoint(path: Path) -> None:
    """Removes a checkpoint folder so that a kill midway leaves no half of it under its name (a partial
    step-N that the record still names would be refused on resume): renamed aside first, then deleted; a
    kill's leftover is deleted when the next writer starts."""
    gone = path.with_name(f".{path.name}.del")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


class CheckpointWriteError(RuntimeError):
    pass


@dataclass
class _Snapshot:
    """What the main rank writes, copied off the live training state into CPU memory: training may go on."""

    head: dict
    head_config: dict
    optimizer: Optional[dict]  # None under DeepSpeed: the engine wrote its own partitions
    scheduler: dict
    trainer_state: dict


class CheckpointWriter:
    """Writes a run's checkpoints, at most one in flight.

    `save` is collective: every rank writes its RNG state (and under DeepSpeed the engine its partitions) into
    the checkpoint's temporary folder, and the main rank snapshots head, optimizer and scheduler into CPU
    memory. The main rank then writes the snapshot, fsyncs and digests every file, adds the digests to the
    record (RECORD) and renames the folder to checkpoints/step-N, then prunes to the last `keep`: before `save`
    returns, or with `background` in a thread while training goes on (the loop waits for the snapshot only).
    The next `save` and `wait` wait for it first, and a failed background write is raised there, on every
    rank, naming the checkpoint. `close` waits without collectives (for a run that is failing anyway)."""

    def __init__(self, train_dir: Path, par, keep: int, background: bool = False):
        self.train_dir, self.par, self.keep, self.background = Path(train_dir), par, keep, background
        self._thread: Optional[threading.Thread] = None
        self._pending: Optional[Path] = None  # on every rank: the checkpoint whose write may still run
        self._error: Optional[BaseException] = None
        if par.is_main:  # what a kill left (one writer per train folder: pipeline/lock.py): a temporary of the
            for stale in stale_tmp_siblings(self.train_dir / RECORD):  # record, checkpoints half removed
                stale.unlink(missing_ok=True)
            for stale in (self.train_dir / CHECKPOINTS).glob(".step-*.del"):
                shutil.rmtree(stale, ignore_errors=True)

    def save(self, model: nn.Module, optimizer, scheduler, trainer_state: dict,
             announce: Callable[[str], None] = lambda event: None, wait: bool = False) -> Path:
        """`announce(event)` is called at "checkpoint_written" (the folder is complete, not yet recorded) and
        "checkpoint_recorded" (recorded, not yet renamed); `wait`: return once the checkpoint is in place (a
        stop request's, which must be whole before the process exits)."""
        self.wait()
        par = self.par
        root = self.train_dir / CHECKPOINTS
        step = int(trainer_state["step"])
        final, tmp = root / f"step-{step}", root / f".step-{step}.tmp"
        if par.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        par.barrier()
        error, snapshot = None, None
        try:
            par.save_engine_state(model, tmp)
            _torch_save(rng_state(), tmp / f"rng-rank{par.rank}.pt")
            if par.is_main:
                head = par.unwrap(model).head
                snapshot = _Snapshot(head_state(head), head.config.to_dict(),
                                     None if par.deepspeed else _cpu_copy(optimizer.state_dict()),
                                     copy.deepcopy(scheduler.state_dict()), copy.deepcopy(trainer_state))
        except Exception as e:  # e.g. a full disk (the engine's partitions are large)
            error = e
        # Every rank learns of a failed write, so none waits at a barrier for a rank that gave up; the folder is
        # removed once all have stopped writing into it. (The main rank's own files fail in _publish: wait.)
        if par.any(error is not None):
            if par.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise error or RuntimeError(f"checkpoint {final}: the write failed on another rank")
        self._pending, self._error = final, None
        if par.is_main:
            job = functools.partial(self._publish, snapshot, tmp, final, announce)
            if self.background:
                self._thread = threading.Thread(target=self._run, args=(job,), name=f"checkpoint {final.name}")
                self._thread.start()
            else:
                self._run(job)
        if wait or not self.background:
            self.wait()
        return final

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # kept for wait(), which raises it on the main thread
            self._error = e

    def _publish(self, snapshot: _Snapshot, tmp: Path, final: Path, announce: Callable[[str], None]) -> None:
        """Main rank: the snapshot's files, then fsync, digests, record, rename, prune."""
        try:
            write_head(snapshot.head, snapshot.head_config, tmp)
            if snapshot.optimizer is not None:
                _torch_save(snapshot.optimizer, tmp / OPTIMIZER)
            _torch_save(snapshot.scheduler, tmp / SCHEDULER)
            for path in sorted(p for p in tmp.rglob("*") if p.is_file()):  # the engine's and other ranks' too
                fsync_file(path)  # DeepSpeed's engine and other ranks do not fsync
            # The state file closes the checkpoint; its list of the other files is for older eaglets and people:
            # a resume checks against the record, which also holds the state file's own digest.
            files = file_digests(tmp)
            _write_json(tmp / TRAINER_STATE, {**snapshot.trainer_state, "files": files})
            files.update(file_digests(tmp, [TRAINER_STATE]))
            for directory in {p.parent for p in tmp.rglob("*")} | {tmp}:
                fsync_dir(directory)
            announce("checkpoint_written")
            if final.exists():  # an older write of this step: gone before the record names the new one
                _remove_checkpoint(final)
            _update_record(self.train_dir, final.name, files)
            announce("checkpoint_recorded")
            replace_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if pruned := checkpoint_dirs(self.train_dir)[:-self.keep] if self.keep > 0 else []:
            for old in pruned:
                _remove_checkpoint(old)
            _update_record(self.train_dir)
        log.info("checkpoint %s", final)

    def wait(self) -> Optional[Path]:
        """Collective: returns once the pending checkpoint is in place (its path; None if none was pending), or
        raises on every rank if its write failed."""
        pending = self._pending
        if pending is None:
            return None
        error = self._join()
        self._pending = None
        if self.par.any(error is not None):
            if error is None:
                raise CheckpointWriteError(f"checkpoint {pending}: the write failed on the main rank")
            if not self.background:
                raise error
            raise CheckpointWriteError(f"checkpoint {pending}: the background write failed: "
                                       f"{type(error).__name__}: {error}") from error
        return pending

    def close(self) -> None:
        """Lets a pending write finish (no collectives: for the exit of a run that failed); its error is logged."""
        if self._pending is not None and (error := self._join()) is not None:
            log.error("checkpoint %s: the background write failed: %s: %s", self._pending, type(error).__name__, error)
        self._pending = None

    def _join(self) -> Optional[BaseException]:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        return error


def _cpu_copy(obj):
    """A copy of a state dict whose tensors are CPU copies (`.to` alone would alias CPU tensors, which the
    optimizer goes on updating in place)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


class CheckpointRefused(ManifestError):
    pass


def check_checkpoint(path: Path, par, verify: bool) -> None:
    """Before anything of checkpoint `path` is loaded (every rank): its files against the train folder's record
    (RECORD), every file of the folder, the hashing split over the ranks. DeepSpeed's files (DS_TAG/) load by
    unpickling, which runs whatever code a file holds, so a checkpoint that has them resumes only checked
    against the record: not unrecorded, not with verify off. The other files load as plain tensors
    (weights_only, safetensors, JSON), so an unrecorded checkpoint without them (an older eaglet's) is checked
    against its own list, as before the record existed."""
    path = Path(path)
    train_dir = path.parent.parent
    record = train_dir / RECORD
    pickled = par.deepspeed or (path / DS_TAG).exists()
    repair = f"delete {path} and rerun: training resumes from the checkpoint before it, or from the start"
    if pickled and not verify:
        raise CheckpointRefused(
            f"checkpoint {path} holds DeepSpeed's files ({DS_TAG}/), which load by unpickling, and unpickling a "
            f"changed file runs whatever code it holds; train.verify_inputs=false would load them unchecked. Rerun "
            f"with train.verify_inputs=true (the default: it reads the checkpoint once) to check them against "
            f"{record} first")
    on_disk = _checkpoint_files(path)
    recorded = read_record(train_dir).get(path.name)
    if recorded is None:
        if pickled:
            raise CheckpointRefused(
                f"checkpoint {path} is not in {record}, the record of the checkpoints this folder's runs wrote (it "
                f"was copied in, or written by an eaglet older than the record): its DeepSpeed files load by "
                f"unpickling, which runs whatever code they hold, and nothing vouches for them. If you wrote it "
                f"and trust it: python -m pipeline.train.checkpoint adopt {path} (checks it against its own list "
                f"and records it), then rerun; else {repair}")
        log.warning("checkpoint %s is not in %s (an older eaglet wrote it, or it was copied in); its files load as "
                    "plain tensors, checked against its own list", path, record)
        if verify and "files" in (state := json.loads((path / TRAINER_STATE).read_text())):
            check_files(path, state["files"], "checkpoint", repair)
        return
    if not verify:
        return
    names = sorted(on_disk | set(recorded))
    problems = []
    for name in names[par.rank::par.world_size]:
        if name not in recorded:
            problems.append(f"{name}: not written by this run (absent from its record)")
        elif problem := file_problem(path / name, recorded[name]["bytes"], recorded[name]["sha256"]):
            problems.append(f"{name}: {problem}")
    if par.any(bool(problems)):  # every rank stops before any loads
        found = "; ".join(problems) if problems else "a file differs (named in another rank's log)"
        raise CheckpointRefused(f"checkpoint {path}: {found}, against {record}; {repair}")


def _checkpoint_files(path: Path) -> set[str]:
    """Every file below checkpoint `path` (relative names). A symbolic link is refused: a linked folder would
    hide its files from the check (and DeepSpeed loads its partitions by glob), a linked file points outside
    what was written."""
    names = set()
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            if os.path.islink(os.path.join(root, name)):
                raise CheckpointRefused(f"checkpoint {path}: {os.path.relpath(os.path.join(root, name), path)} is a "
                                        f"symbolic link; a checkpoint holds only the files its run wrote")
        names.update(os.path.relpath(os.path.join(root, f), path) for f in files)
    return names


def adopt(path: Path) -> dict:
    """Records checkpoint `path` (one an older eaglet wrote, or one moved here from another train folder) in its
    train folder's record, after checking it against its own list: every file listed, unchanged, and no file
    beyond the list. For a checkpoint you wrote: the record then vouches for it on resume."""
    path = Path(path)
    state_file = path / TRAINER_STATE
    if not state_file.is_file():
        raise CheckpointRefused(f"{path}: no {TRAINER_STATE}: not a complete checkpoint")
    listed = json.loads(state_file.read_text()).get("files")
    if listed is None:
        raise CheckpointRefused(f"checkpoint {path}: its {TRAINER_STATE} lists no files (an eaglet older than the "
                                f"digests wrote it): nothing to check it against")
    on_disk = _checkpoint_files(path)
    if extra := sorted(on_disk - set(listed) - {TRAINER_STATE}):
        raise CheckpointRefused(f"checkpoint {path}: {', '.join(extra)} not in its own list of files")
    check_files(path, listed, "checkpoint", f"it cannot be adopted; delete {path}")
    files = file_digests(path, sorted(on_disk))
    _update_record(path.parent.parent, path.name, files)
    log.info("checkpoint %s recorded in %s (%d files)", path, path.parent.parent / RECORD, len(files))
    return files


def load_checkpoint(path: Path, par, model: nn.Module, optimizer, scheduler, verify: bool = True) -> dict:
    """Restore what `CheckpointWriter` wrote into an already prepared model/optimizer; returns trainer_state.
    First `check_checkpoint` (`verify`: the digests), so a corrupt or changed checkpoint stops the run, named,
    before anything of it is loaded."""
    path = Path(path)
    check_checkpoint(path, par, verify)
    state = json.loads((path / TRAINER_STATE).read_text())
    load_head_weights(par.unwrap(model).head, path)
    if par.deepspeed:
        par.load_engine_state(model, path)
    else:
        optimizer.load_state_dict(torch.load(path / OPTIMIZER, map_location="cpu", weights_only=True))
    scheduler.load_state_dict(torch.load(path / SCHEDULER, weights_only=True))
    rng_file = path / f"rng-rank{par.rank}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than were saved; data order does not need it
        set_rng_state(torch.load(rng_file, weights_only=True))
    return state


# ---------------------------------------------------------------------------------------------------------
# stop requests


class StopRequest:
    """SIGTERM (Slurm's preemption/time-limit signal, also what torchrun forwards) and SIGUSR1 (`sbatch
    --signal=USR1@90`) only set a flag; the loop checkpoints at the next step boundary and exits with
    REQUEUE_EXIT_CODE."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.requested = False
        self._previous = {}

    def _handler(self, signum, frame) -> None:
        if not self.requested:
            log.warning("received %s: checkpointing at the next step boundary, then exiting with %d",
                        signal.Signals(signum).name, REQUEUE_EXIT_CODE)
        self.requested = True

    def __enter__(self) -> "StopRequest":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


# ---------------------------------------------------------------------------------------------------------


def _torch_save(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Train checkpoints: `adopt <checkpoints/step-N>` records a checkpoint "
                                             "in its train folder's record after checking it against its own list.")
    ap.add_argument("action", choices=["adopt"])
    ap.add_argument("checkpoint", type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    adopt(args.checkpoint)


if __name__ == "__main__":
    main()
