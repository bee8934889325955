"""A carried run: a train run's progress, small enough to commit, from which a fresh machine continues it.

    <carry dir>/carry.json           step, total steps, what was left behind, every file's size and sha256
    <carry dir>/model.safetensors    the head's trained weights in bf16 (d2t/t2d as they are) + head_config.json
    <carry dir>/trainer_state.json   the checkpoint's: step, data position, lr schedule, what it trained on
    <carry dir>/metrics.jsonl.gz     the run's metrics up to the step: its curves and the tau probes
    <carry dir>/best/                train.select=tau: the best-tau head so far, when it is not the step's own
                                     (a complete run's carry holds this head alone: final/ is made of it)

`python -m pipeline.train.carry save <train dir> <carry dir>` writes one from the train folder's last checkpoint;
where the two heads would exceed the budget, from the best-tau head's checkpoint if that rewinds a few steps,
else without the best head (save_carry);
`train.carry_from=<carry dir>` continues it where the train folder has no checkpoint of its own (a fresh machine);
`python -m pipeline.train.carry check [--complete] <carry dir>` checks its files and says where it stands.

Left behind: AdamW's moments (twice the weights in fp32: 80 MB for a 10M-parameter head, against ~20 MB carried),
the fp32 master weights and the RNG states (pickles; the data order and EAGLE-1's noise are seeded per step and
need none). So a carried run is not the uninterrupted run: it goes on from bf16-rounded weights with fresh moments
and the lr ramped again over train.carry_warmup_steps, and its manifest records every carry (`carries`). Where the
checkpoints stay (the same machine, a cluster file system), resume from them instead: that is exact.

A carry of a finished run (step = total steps) gives back its final/ on a fresh machine without training; in bf16,
the precision the eval stage runs a head in, it is the same head."""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch

from pipeline.files import atomic_dir, sha256_file
from pipeline.heads.io import HEAD_CONFIG, HEAD_WEIGHTS
from pipeline.manifest import MANIFEST, ManifestError, check_files, file_digests, file_problem, rebuilt_from

from .checkpoint import BEST, SELECTED, TRAINER_STATE, checkpoint_dirs, latest_checkpoint, read_record
from .metrics import read_metrics

CARRY = "carry.json"
CARRY_FORMAT = 1
METRICS_GZ = "metrics.jsonl.gz"
LEFT_BEHIND = ["optimizer moments", "fp32 weights", "rng states"]
BUDGET_BYTES = 25_000_000  # a committed head's limit (docs/results/quality.md): a carry stays within one
# Over the budget, a carry rewinds to the best head's checkpoint when that retrains at most this many steps; further
# back (a noisy probe's early best), it carries the step's head alone and leaves the best one behind.
MAX_REWIND_STEPS = 100


class CarryError(ManifestError):
    """A carry that is missing, damaged or not this run's (a pipeline error: one line at the command line)."""


def _bf16_head(src: Path, dest: Path) -> None:
    """The head of `src` (model.safetensors + head_config.json) with its floating tensors in bf16."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(src / HEAD_WEIGHTS))
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
    dest.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dest / HEAD_WEIGHTS), metadata={"format": "pt"})
    shutil.copyfile(src / HEAD_CONFIG, dest / HEAD_CONFIG)


def _carry_again(origin: dict, dest: Path) -> dict:
    """The carry of a run rebuilt from the complete carry `origin` (a `carries` entry): that carry as it was, never
    one naming the rebuilding machine as the one that trained it."""
    source = Path(origin["carry"])
    for where in (dest, source):
        if (where / CARRY).is_file() and sha256_file(where / CARRY) == origin["carry_sha256"]:
            record = read_carry(where)
            if where != dest:
                with atomic_dir(dest) as tmp:
                    shutil.copytree(where, tmp, dirs_exist_ok=True)
            return record
    raise CarryError(f"its head was rebuilt from the complete carry {source} (no step trained here), which is not "
                     f"there as it was (carry.json sha256 {origin['carry_sha256'][:12]}): check it out from git")


def save_carry(train_dir: Path, dest: Path, budget_bytes: Optional[int] = BUDGET_BYTES,
               max_rewind_steps: Optional[int] = MAX_REWIND_STEPS) -> dict:
    """Writes the carry of `train_dir`'s last checkpoint to `dest` (replaced whole); returns its carry.json.

    With train.select=tau the carry holds the best-tau head as well, when that is not the step's own. Where the
    two heads exceed `budget_bytes` (what one committed head may take), the carry holds one head:
    - the best head's checkpoint, when it is still kept and at most `max_rewind_steps` back (None: any): the steps
      after it (`rewound_steps`) are trained again on the machine that continues it;
    - else the step's own head: the best one is left behind (`best_left_behind`), and the continued run chooses
      among the probes after the carry.
    A complete run's carry holds one head, the one its final/ is: nothing trains on from the last step's. A run whose
    head was rebuilt from a complete carry carries that carry unchanged (rebuilt_from)."""
    train_dir, dest = Path(train_dir), Path(dest)
    if (train_dir / MANIFEST).is_file() and (origin := rebuilt_from(json.loads((train_dir / MANIFEST).read_text()))):
        return _carry_again(origin, dest)
    checkpoint = latest_checkpoint(train_dir)
    if checkpoint is None:
        raise CarryError(f"{train_dir}: no checkpoint to carry (a run writes one every train.save_every steps, on a "
                         f"stop request and at the end)")
    record = _write_carry(train_dir, checkpoint, dest)
    best = record["best"]
    if (budget_bytes is None or carry_bytes(record) <= budget_bytes or best is None or best["step"] == record["step"]
            or record["complete"]):  # (a complete run's carry holds one head: final/'s)
        return record
    at_best = checkpoint.with_name(f"step-{best['step']}")
    rewind = record["step"] - best["step"]
    if at_best in checkpoint_dirs(train_dir) and (max_rewind_steps is None or rewind <= max_rewind_steps):
        return _write_carry(train_dir, at_best, dest, rewound_steps=rewind)
    return _write_carry(train_dir, checkpoint, dest, leave_best=True)


def carry_bytes(record: dict) -> int:
    return sum(f["bytes"] for f in record["files"].values())


def _write_carry(train_dir: Path, checkpoint: Path, dest: Path, rewound_steps: int = 0,
                 leave_best: bool = False) -> dict:
    # the files carried, against the record the run wrote beside its checkpoints: a damaged one is not carried on
    recorded = read_record(train_dir).get(checkpoint.name, {})
    problems = [f"{name}: {problem}" for name, r in recorded.items() if name in (HEAD_WEIGHTS, TRAINER_STATE)
                and (problem := file_problem(checkpoint / name, r["bytes"], r["sha256"]))]
    if problems:
        raise CarryError(f"checkpoint {checkpoint}: {'; '.join(problems)}; carry an earlier checkpoint (delete this "
                         f"one) or train on from it here")
    state = json.loads((checkpoint / TRAINER_STATE).read_text())
    if "portable_identity" not in state:
        raise CarryError(f"checkpoint {checkpoint} was written by an eaglet older than carries (no "
                         f"portable_identity): continue it here, from its checkpoint, then carry a later one")
    step = int(state["step"])
    manifest = train_dir / MANIFEST  # written after the last checkpoint: the run is complete at this step
    run_manifest = json.loads(manifest.read_text()) if manifest.is_file() else None
    complete = run_manifest is not None and run_manifest["counts"]["steps"] == step
    best = None
    if (train_dir / BEST / SELECTED).exists():
        best = json.loads((train_dir / BEST / SELECTED).read_text())
    left = None
    if leave_best and best is not None and best["step"] != step:
        best, left = None, best
    best_apart = best is not None and best["step"] != step  # else the step's own head is the best: carried once
    with atomic_dir(dest) as tmp:
        if not (complete and best_apart):  # (a complete run's final/ is best/'s head: only it is carried)
            _bf16_head(checkpoint, tmp)
        shutil.copyfile(checkpoint / TRAINER_STATE, tmp / TRAINER_STATE)
        records = [r for r in read_metrics(train_dir / "metrics.jsonl") if r["step"] <= step]
        # mtime 0 and no name: the same run carries the same bytes (a commit that changes nothing is empty)
        with open(tmp / METRICS_GZ, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records).encode())
        if best_apart:
            _bf16_head(train_dir / BEST, tmp / BEST)
            shutil.copyfile(train_dir / BEST / SELECTED, tmp / BEST / SELECTED)
        record = {"format": CARRY_FORMAT, "step": step, "total_steps": int(state["total_steps"]),
                  "complete": complete,
                  # the complete run's manifest: evals of its head count for the head a fresh machine rebuilds
                  "train_manifest_sha256": sha256_file(manifest) if complete else None,
                  # where the complete run trained: a fresh machine rebuilding its head trains nothing itself
                  "machine": run_manifest.get("machine") if complete else None,
                  "checkpoint": checkpoint.name, "rewound_steps": rewound_steps, "weights_dtype": "bfloat16",
                  "best": best,
                  # the best head over the budget (save_carry): its probe stays in the metrics, its weights here
                  "best_left_behind": left,
                  "left_behind": LEFT_BEHIND + (["best head"] if left else []), "files": file_digests(tmp)}
        (tmp / CARRY).write_text(json.dumps(record, indent=2) + "\n")
    return record


def read_carry(path: Path) -> dict:
    """carry.json of `path` after checking every file against it; refuses a missing or damaged carry."""
    path = Path(path)
    if not (path / CARRY).is_file():
        raise CarryError(f"train.carry_from={path}: no {CARRY} there (write one with `python -m pipeline.train.carry "
                         f"save <train dir> {path}`)")
    record = json.loads((path / CARRY).read_text())
    if record.get("format") != CARRY_FORMAT:
        raise CarryError(f"{path / CARRY}: carry format {record.get('format')}, this eaglet reads {CARRY_FORMAT}")
    try:
        check_files(path, record["files"], "carry", "the carry is damaged: check it out again from git, or train anew")
    except ManifestError as e:
        raise CarryError(str(e)) from None
    return record


def head_path(path: Path) -> Path:
    """The folder of the head a carry continues from: its step's, or best/'s where a complete run's carry holds
    only that one."""
    path = Path(path)
    return path if (path / HEAD_WEIGHTS).is_file() else path / BEST


def trainer_state(path: Path) -> dict:
    return json.loads((Path(path) / TRAINER_STATE).read_text())


def restore_records(path: Path, train_dir: Path) -> None:
    """The carry's metrics and best/ into a train folder that has no run of its own (main rank)."""
    path, train_dir = Path(path), Path(train_dir)
    with gzip.open(path / METRICS_GZ, "rt") as f:
        (train_dir / "metrics.jsonl").write_text(f.read())
    if (path / BEST).is_dir():
        with atomic_dir(train_dir / BEST) as tmp:
            for name in (HEAD_WEIGHTS, HEAD_CONFIG, SELECTED):
                shutil.copyfile(path / BEST / name, tmp / name)


def describe(record: dict) -> str:
    best = record.get("best")
    rewound = record.get("rewound_steps", 0)
    return (f"step {record['step']} of {record['total_steps']}" + (", complete" if record["complete"] else "") +
            (f", best tau {best['tau']:.3f} at step {best['step']}" if best else "") +
            (f" (the best head, tau {left['tau']:.3f} at step {left['step']}, left behind: the run chooses among "
             f"the probes after step {record['step']})" if (left := record.get("best_left_behind")) else "") +
            (f" (the best head's checkpoint: the {rewound} steps after it are trained again)" if rewound else ""))


def main(argv: Optional[list] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pipeline.train.carry", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save", help="carry a train folder's last checkpoint")
    s.add_argument("train_dir", type=Path)
    s.add_argument("dest", type=Path)
    s.add_argument("--budget-mb", type=float, default=BUDGET_BYTES / 1e6,
                   help="above this the carry holds one head: the best head's checkpoint where it is kept and near, "
                        "else the last step's (0: no budget)")
    s.add_argument("--max-rewind-steps", type=int, default=MAX_REWIND_STEPS,
                   help="over the budget, rewind to the best head's checkpoint only within this many steps "
                        "(-1: any)")
    c = sub.add_parser("check", help="check a carry's files and say where it stands")
    c.add_argument("path", type=Path)
    c.add_argument("--complete", action="store_true", help="exit 1 unless it is of a complete run")
    args = p.parse_args(argv)
    try:
        if args.cmd == "save":
            record = save_carry(args.train_dir, args.dest, None if args.budget_mb == 0 else int(args.budget_mb * 1e6),
                                None if args.max_rewind_steps < 0 else args.max_rewind_steps)
            print(f"{args.dest}: {describe(record)}, {carry_bytes(record) / 1e6:.1f} MB")
        else:
            record = read_carry(args.path)
            print(f"{args.path}: {describe(record)}")
            if args.complete and not record["complete"]:
                sys.exit(1)
    except ManifestError as e:
        sys.exit(f"carry: {e}")


if __name__ == "__main__":
    main()
