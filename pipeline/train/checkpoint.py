"""Checkpoints of the train stage.

    <train dir>/checkpoints/step-N/   head (trainable weights + vocab maps), optimizer, scheduler, RNG states
                                      of every rank, trainer_state.json (step, data position); written to a
                                      temporary directory and renamed, so a step-N directory is always whole
    <train dir>/final/                the trained head (pipeline/heads/io.py): what export and eval load"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn

from pipeline.files import atomic_write_text, fsync_dir, replace_dir
from pipeline.heads.io import load_head_weights, save_head
from pipeline.manifest import check_files, file_digests

log = logging.getLogger(__name__)

# sysexits.h EX_TEMPFAIL ("try again later"): the run was asked to stop (SIGTERM/SIGUSR1), saved a checkpoint
# and exited; scripts requeue on this code and the rerun resumes. Distinct from crashes (1) and signals (128+n).
REQUEUE_EXIT_CODE = 75

CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
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


def save_checkpoint(train_dir: Path, par, model: nn.Module, optimizer, scheduler, trainer_state: dict,
                    keep: int, before_rename=None) -> Path:
    """Collective: every rank calls it. Rank 0 writes the head/optimizer/scheduler/state, every rank its RNG
    state (and, under DeepSpeed, its optimizer partition) into a temporary directory that rank 0 then renames
    to checkpoints/step-N and prunes to the last `keep`."""
    root = Path(train_dir) / CHECKPOINTS
    step = int(trainer_state["step"])
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    if par.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    par.barrier()
    error = None
    try:
        par.save_engine_state(model, tmp)
        _torch_save(rng_state(), tmp / f"rng-rank{par.rank}.pt")
        if par.is_main:
            save_head(par.unwrap(model).head, tmp)
            if not par.deepspeed:
                _torch_save(optimizer.state_dict(), tmp / OPTIMIZER)
            _torch_save(scheduler.state_dict(), tmp / SCHEDULER)
    except Exception as e:  # e.g. a full disk, which rank 0 (the big files) meets first
        error = e
    # Every rank learns of a failed write, so none waits at a barrier for a rank that gave up; the folder is
    # removed once all have stopped writing into it.
    if par.any(error is not None):
        if par.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error or RuntimeError(f"checkpoint {final}: the write failed on another rank")
    # every rank's files are in place before the state file marks the checkpoint complete (par.any synced)
    if par.is_main:
        # The state file closes the checkpoint and records every other file's digest: a resume refuses a
        # checkpoint whose bytes changed since (load_checkpoint).
        _write_json(tmp / TRAINER_STATE, {**trainer_state, "files": file_digests(tmp)})
        fsync_dir(tmp)
        if before_rename is not None:
            before_rename()
        replace_dir(tmp, final)
        for old in checkpoint_dirs(train_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s", final)
    par.barrier()
    return final


def load_checkpoint(path: Path, par, model: nn.Module, optimizer, scheduler, verify: bool = True) -> dict:
    """Restore what `save_checkpoint` wrote into an already prepared model/optimizer; returns trainer_state.
    `verify`: first check every file against the digests in its trainer_state.json (older checkpoints have
    none), so a corrupt checkpoint stops the run, named, instead of resuming from garbage."""
    path = Path(path)
    state = json.loads((path / TRAINER_STATE).read_text())
    if verify and "files" in state:
        check_files(path, state["files"], "checkpoint",
                    f"delete {path} and rerun: training resumes from the checkpoint before it, or from the start")
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


