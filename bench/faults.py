"""Fault campaign: SIGKILL every stage of the chain at seeded random moments, rerun it, and check that the
resumed run's artefacts equal an uninterrupted run's.

    python -m bench.faults                      # the demo target (SmolLM2-135M), 10 kills per stage
    python -m bench.faults --kills 3 --stages train,eval
    python -m bench.faults --tiny --kills 1     # the suite's tiny random Llama (tests/test_faults.py)

First an uninterrupted reference chain (regen with the in-process HF engine, dump, train, eval, export) runs
in <work>/reference, each stage a real `python -m pipeline.run` process; it times every stage: the moment its
first file appears in its output directory, its last write (the manifest) and its exit. Then, per stage, N
trials (--kills): a fresh output root gets a copy of the reference's earlier stages (the stage's input, never a
killed run's output), the stage starts, and is SIGKILLed (its whole process group) at a moment t_i; the same
command is rerun to completion and its artefacts are compared with the reference's:

    regen   shards/ and errors/ (the target's answers), byte for byte
    dump    shard-*.arrow, byte for byte
    train   metrics.jsonl: every per-step loss to 1e-6, every other metric too (timings excepted);
            final/model.safetensors tensor by tensor (exactly) and final/head_config.json
    eval    answers.jsonl and summary.json without their timings (answers, accept lengths, tau, ...)
    export  every file of export/<head>/<format>/ (model.safetensors, config.json), byte for byte
    and each stage's manifest.json without MANIFEST_EXCLUDED (dates and timings; output roots normalised).

Moments: kill i of N sits at the fraction f_i = (i + u_i) / N of the stage's work (u_i seeded uniform, so the
kills spread over the whole stage and a run is reproducible). With --anchor write (the default) the work is
the reference's span from its first output file to its last write (its manifest), and t_i is f_i of that span
after the trial's own first file appeared: startup (imports, target load) writes nothing, the interpreter's
teardown after the manifest neither, and anchoring on the first write removes the startup's jitter, which for
short stages (export writes for milliseconds) is far larger than the writing itself. --anchor start measures
t_i from the process start over the reference's whole duration instead (many kills then land before any
write or after the last one).

A kill that comes too late (this run was faster than the reference's) is retried, on fresh inputs, at the same
fraction of the span that run took (at most 3 attempts, recorded). Each kill is classified by what it left:
`too_late` (the stage had already exited), `mid_write` (a temporary
of an atomic writer -- `.shard-N.arrow.tmp`, `.step-N.tmp`, `.<name>.<pid>.tmp` (pipeline/files.py),
`.metrics.jsonl.tmp`, ... -- or a torn last line of an appended *.jsonl was in the stage directory right after
the kill), `before_write` (no file yet) or `between_writes`. Temporaries still there after the resume are
reported as leftovers (garbage, not a difference). Results: bench/results/faults.json (faults_tiny.json with
--tiny): per stage kills, mid_write, resumed, identical and every kill's details, plus the configuration and
the machine; a campaign over some stages (--stages) replaces just their entries in an existing file. The exit
status is 1 when any resume failed or any artefact differed; each difference is printed.

Children run single-threaded (OMP_NUM_THREADS=1: the stages are bit-reproducible at a fixed thread count)
with W&B disabled (not an artefact under test; it would add a service process to every run).

Cost, measured on 2 shared cores (an Intel Xeon VM), children on one thread each: every stage run pays 5-7 s of
interpreter startup (torch, transformers, the target's load) before its first write. The shrunk demo chain
(REAL_OVERRIDES) takes 108 s uninterrupted (regen 26, dump 11, train 31, eval 33, export 7); a trial costs
about one startup more than a stage run (the killed part plus the resume), about 140 s per round of five
stages, so --kills 1 took 3.6 minutes and the full campaign (--kills 10) costs about 25 minutes.
--tiny --kills 1 takes 80-100 s (15 runs of about 6 s, nearly all startup).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]

STAGES = ("regen", "dump", "train", "eval", "export")
NAME, HEAD, EVAL_RUN = "faults", "eagle3", "faults"

# The demo experiment shrunk to a chain that runs in under 2 minutes on 2 cores, with several units of work per
# stage so that kills find resume points: 4 regen shards, 6 dump shards, 6 train steps with a checkpoint (and
# a real-tau probe) every 2, 2 eval questions.
REAL_OVERRIDES = [
    "regen.limit=12", "regen.max_new_tokens=48", "regen.batch_size=3", "regen.batches_per_shard=1",
    "dump.shard_bytes=1000000", "dump.max_batch_size=2",
    "train.epochs=2", "train.micro_batch_tokens=512", "train.warmup_steps=2", "train.save_every=2",
    "train.eval_every=2", "train.tau_prompts=1", "train.tau_max_new_tokens=16",
    "eval.limit=2", "eval.max_new_tokens=48", "eval.baseline=false",
]
# The suite's tiny random Llama: every stage is a few seconds, mostly interpreter startup.
TINY_OVERRIDES = [
    "target=hf", "target.name=tiny",
    "regen.limit=4", "regen.max_new_tokens=16", "regen.batch_size=1", "regen.batches_per_shard=1",
    "dump.batch_tokens=256", "dump.max_batch_size=2", "dump.shard_bytes=60000",
    "head.draft_vocab_size=200", "train.epochs=2", "train.lr=3e-3", "train.warmup_steps=2",
    "train.micro_batch_tokens=256", "train.save_every=2", "train.eval_every=2", "train.tau_prompts=1",
    "train.tau_max_new_tokens=8", "train.val_fraction=0.2", "train.plot=false",
    "eval.limit=2", "eval.max_new_tokens=16", "eval.baseline=false", "tree.depth=4", "tree.top_k=4",
    "tree.total_tokens=16",
]

# Manifest keys left out of the comparison: they record when and how fast a run went, not what it produced.
MANIFEST_EXCLUDED = {
    "*": ["created",  # the wall-clock date of the write
          "timings",  # durations and rates of this run (a resumed run's cover only its own part)
          # `git describe --dirty` of the checkout: a commit made while the campaign runs (a shared working
          # tree) changes it without changing the code; the results record it at the start and the end.
          "code_version"],
    # The last logged value of every metric: the speed of the last step and the tau probe's decode time.
    "train": ["final_metrics.tokens_per_s", "final_metrics.eval/decode_s"],
    "eval": ["speedup"],  # a ratio of two wall times
}
# Timing fields of the per-step metrics and of eval's answers and summary (time.perf_counter() differences).
METRIC_TIMINGS = {"tokens_per_s", "eval/decode_s"}
ANSWER_TIMINGS = {"wall_s", "target_s", "draft_s", "other_s", "baseline_wall_s", "fp32_baseline_wall_s"}
SUMMARY_TIMINGS = {"spec_wall_s", "spec_tokens_per_s", "time_fraction", "baseline_wall_s", "baseline_tokens_per_s",
                   "baseline_tokens_per_s_by_precision", "baseline_precision", "speedup"}
LOSS_TOLERANCE = 1e-6
# pipeline/lock.py: a stage holds this file (flock) while it runs; it is no output and is written at the start.
LOCK_PREFIX = ".eaglet-lock.rank"


# ---------------------------------------------------------------------------------------------------------
# the chain


def stage_dir(root: Path, stage: str) -> Path:
    """EagletConfig.stage_dir for this campaign's experiment name, head and eval run name."""
    exp = root / NAME
    return {"regen": exp / "regen", "dump": exp / "dump", "train": exp / "train" / HEAD,
            "eval": exp / "eval" / HEAD / EVAL_RUN, "export": exp / "export" / HEAD}[stage]


def stage_command(stage: str, root: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "pipeline.run", f"stage={stage}", "experiment=demo", f"name={NAME}",
            f"output_root={root}", f"eval.run_name={EVAL_RUN}", "regen.backend=hf", "regen.progress=false",
            "wandb.mode=disabled", *overrides]


def child_env(tiny: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", WANDB_MODE="disabled")  # WANDB_MODE wins over wandb.mode: set both
    if tiny:
        env["EAGLET_FAST_BF16"] = "0"  # as in the suite: fp32, whatever the CPU
    return env


def copy_inputs(ref_root: Path, root: Path, stage: str) -> None:
    """The reference's earlier stages: what this stage reads, as an uninterrupted chain left them. Training
    checkpoints are left out (later stages read final/ only; they are the bulk of the bytes)."""
    for earlier in STAGES[:STAGES.index(stage)]:
        src = stage_dir(ref_root, earlier)
        shutil.copytree(src, stage_dir(root, earlier), ignore=shutil.ignore_patterns("checkpoints"))


def build_tiny_target(path: Path) -> Path:
    """The suite's seeded tiny Llama and its tokenizer (tests/support/tiny.py) as a local HF directory."""
    from tests.support.tiny import build_tiny_llama, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    build_tiny_llama(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def warm_target_cache(env: dict) -> None:
    """Dequantize the demo GGUF into eaglet's cache now, so that it does not inflate the regen reference."""
    code = "from pipeline.config import TargetConfig; from pipeline.target import materialize; " \
           "materialize(TargetConfig())"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True)


# ---------------------------------------------------------------------------------------------------------
# processes


def start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        # Own session: the kill reaches every process the stage started (its process group).
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def output_files(directory: Path) -> Iterator[Path]:
    """Every file the stage wrote so far (os.walk: folders renamed or removed meanwhile are skipped)."""
    for parent, _, names in os.walk(directory):
        yield from (Path(parent) / n for n in names if not n.startswith(LOCK_PREFIX))


def has_file(directory: Path) -> bool:
    return next(output_files(directory), None) is not None


def last_write(directory: Path) -> float:
    """The wall-clock time of the stage's last write (its manifest, usually)."""
    return max(p.stat().st_mtime for p in output_files(directory))


def wait_first_write(proc: subprocess.Popen, directory: Path, poll_s: float = 0.005) -> bool:
    """Polls until a file exists in `directory`; False if the process exited first."""
    while not has_file(directory):
        if proc.poll() is not None:
            return has_file(directory)
        time.sleep(poll_s)
    return True


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # exited between the check and the kill
        pass
    proc.wait()


def run_to_end(cmd: list[str], env: dict, log: Path, timeout_s: float) -> tuple[int, float]:
    """(exit status, seconds); a run past the timeout is killed and reported as status -9."""
    t0 = time.monotonic()
    proc = start(cmd, env, log)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        rc = -signal.SIGKILL
    return rc, time.monotonic() - t0


def run_reference(stage: str, cmd: list[str], env: dict, root: Path) -> dict:
    """One uninterrupted run, timed: when its first file appeared, when it wrote last, when it exited (after
    the interpreter's teardown, a second or so)."""
    log = root / "logs" / f"{stage}.log"
    t0 = time.time()
    proc = start(cmd, env, log)
    wait_first_write(proc, stage_dir(root, stage))
    first = time.time() - t0
    rc = proc.wait()
    duration = time.time() - t0
    if rc != 0:
        raise SystemExit(f"reference {stage} failed (exit {rc}); log: {log}\n{tail(log)}")
    last = last_write(stage_dir(root, stage)) - t0
    return {"duration_s": round(duration, 3), "first_write_s": round(min(first, last), 3),
            "last_write_s": round(last, 3)}


def tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.is_file() else ""


# ---------------------------------------------------------------------------------------------------------
# what a kill left


def temporaries(directory: Path) -> list[str]:
    """Temporary files and directories of the atomic writers (every one is named `.<name>.tmp` or
    `.<name>.<pid>.tmp`), relative to `directory`."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob(".*.tmp")) if directory.is_dir() else []


def torn_lines(directory: Path) -> list[str]:
    """Appended JSON-lines files (regen's journal, metrics.jsonl, answers.partial.jsonl) cut mid-line."""
    torn = []
    for path in sorted(directory.rglob("*.jsonl")) if directory.is_dir() else ():
        size = path.stat().st_size
        if size:
            with open(path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    torn.append(str(path.relative_to(directory)))
    return torn


def classify(exited: bool, directory: Path) -> tuple[str, list[str]]:
    """(outcome, the temporaries and torn files seen) of a kill."""
    if exited:
        return "too_late", []
    seen = temporaries(directory) + [f"{name} (torn last line)" for name in torn_lines(directory)]
    if seen:
        return "mid_write", seen
    return ("between_writes" if has_file(directory) else "before_write"), []


def kill_at(cmd: list[str], env: dict, directory: Path, log: Path, moment_s: float, anchor: str) -> dict:
    """Starts the stage and SIGKILLs it `moment_s` after its first write (anchor write) or its start."""
    t0 = time.monotonic()
    proc = start(cmd, env, log)
    if anchor == "write" and not wait_first_write(proc, directory):
        return {"outcome": "failed_before_write", "exit": proc.returncode, "seen": []}
    start_s = time.monotonic() if anchor == "write" else t0
    try:
        proc.wait(timeout=max(start_s + moment_s - time.monotonic(), 0))
        exited = True
    except subprocess.TimeoutExpired:
        kill_group(proc)
        exited = False
    outcome, seen = classify(exited, directory)
    out = {"outcome": outcome, "seen": seen, "killed_after_s": round(time.monotonic() - t0, 3)}
    if exited:  # how long this run's span really was: a late kill is retried at the same fraction of it
        out.update(exit=proc.returncode, span_s=time.monotonic() - start_s)
    return out


# ---------------------------------------------------------------------------------------------------------
# comparisons: each returns the differences as readable lines (empty: identical)


def artefacts(directory: Path, pattern: str) -> set[str]:
    """Files matching `pattern`, outside temporaries (pathlib's glob also enters `.<name>.tmp` folders)."""
    found = (p.relative_to(directory) for p in directory.glob(pattern) if p.is_file())
    return {str(p) for p in found if not any(part.startswith(".") for part in p.parts)}


def compare_bytes(ref: Path, out: Path, patterns: list[str]) -> list[str]:
    diffs = []
    for pattern in patterns:
        ours, theirs = artefacts(out, pattern), artefacts(ref, pattern)
        if ours != theirs:
            diffs.append(f"{pattern}: files {sorted(ours)} after the resume, {sorted(theirs)} in the reference")
        for name in sorted(ours & theirs):
            if (out / name).read_bytes() != (ref / name).read_bytes():
                diffs.append(f"{name}: bytes differ")
    return diffs


def compare_regen(ref: Path, out: Path) -> list[str]:
    return compare_bytes(ref, out, ["shards/*.jsonl", "errors/*.jsonl"])


def compare_dump(ref: Path, out: Path) -> list[str]:
    return compare_bytes(ref, out, ["shard-*.arrow"])


def metric_values(path: Path) -> dict[tuple[int, str], float]:
    """(step, metric) -> value over every record of metrics.jsonl (a step can have several records)."""
    values = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        record = json.loads(line)
        values.update({(record["step"], k): v for k, v in record.items() if k != "step" and k not in METRIC_TIMINGS})
    return values


def close(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= LOSS_TOLERANCE
    return a == b


def record_layout(path: Path) -> list[tuple[int, list[str]]]:
    """(step, metric names) of each record in order: a record written twice or out of order shows here."""
    lines = path.read_text().splitlines() if path.is_file() else []
    records = [json.loads(line) for line in lines]
    return [(r["step"], sorted(k for k in r if k != "step" and k not in METRIC_TIMINGS)) for r in records]


def compare_metrics(ref: Path, out: Path) -> list[str]:
    ours, theirs = metric_values(out / "metrics.jsonl"), metric_values(ref / "metrics.jsonl")
    diffs = []
    layout, ref_layout = record_layout(out / "metrics.jsonl"), record_layout(ref / "metrics.jsonl")
    if layout != ref_layout:
        diffs.append(f"metrics.jsonl: {len(layout)} records (steps {[s for s, _ in layout]}) after the resume, "
                     f"{len(ref_layout)} (steps {[s for s, _ in ref_layout]}) in the reference")
    for key in sorted(set(ours) | set(theirs)):
        kind = "loss" if "loss" in key[1] else "metric"
        if key not in ours or key not in theirs:
            where = "the resumed run" if key not in ours else "the reference"
            diffs.append(f"metrics.jsonl: {kind} {key[1]} of step {key[0]} missing in {where}")
        elif not close(ours[key], theirs[key]):
            diffs.append(f"metrics.jsonl: {kind} {key[1]} of step {key[0]}: {ours[key]} (resumed) against "
                         f"{theirs[key]} (reference)")
    return diffs


def compare_head(ref: Path, out: Path) -> list[str]:
    import torch
    from safetensors.torch import load_file

    path = Path("final") / "model.safetensors"
    if not (out / path).is_file():
        return [f"{path}: missing after the resume"]
    ours, theirs = load_file(out / path), load_file(ref / path)
    if set(ours) != set(theirs):
        return [f"{path}: tensors {sorted(set(ours) ^ set(theirs))} in one head only"]
    diffs = [f"{path}: tensor {k} differs (max |diff| {(ours[k].double() - theirs[k].double()).abs().max():.3g})"
             for k in sorted(ours) if ours[k].dtype != theirs[k].dtype or not torch.equal(ours[k], theirs[k])]
    return diffs + compare_bytes(ref, out, ["final/head_config.json"])


def compare_train(ref: Path, out: Path) -> list[str]:
    return compare_metrics(ref, out) + compare_head(ref, out)


def without(doc: dict, keys: set[str]) -> dict:
    return {k: v for k, v in doc.items() if k not in keys}


def compare_eval(ref: Path, out: Path) -> list[str]:
    if not (out / "answers.jsonl").is_file():
        return ["answers.jsonl: missing after the resume"]
    ours, theirs = ([without(json.loads(line), ANSWER_TIMINGS) for line in (d / "answers.jsonl").read_text()
                     .splitlines()] for d in (out, ref))
    diffs = [f"answers.jsonl: {len(ours)} turns after the resume, {len(theirs)} in the reference"] \
        if len(ours) != len(theirs) else []
    for a, b in zip(ours, theirs):
        diffs += [f"answers.jsonl: question {b['question_id']} turn {b['turn']}: {path}" for path in diff_paths(a, b)]
    ours, theirs = (without(json.loads((d / "summary.json").read_text()), SUMMARY_TIMINGS) for d in (out, ref))
    return diffs + [f"summary.json: {path}" for path in diff_paths(ours, theirs)]


def compare_export(ref: Path, out: Path) -> list[str]:
    return compare_bytes(ref, out, ["*/model.safetensors", "*/config.json"])


COMPARE = {"regen": compare_regen, "dump": compare_dump, "train": compare_train, "eval": compare_eval,
           "export": compare_export}


def diff_paths(a, b, path: str = "") -> list[str]:
    """Where two JSON documents differ, as key paths."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [p for k in sorted(set(a) | set(b), key=str)
                for p in (diff_paths(a[k], b[k], f"{path}.{k}".lstrip(".")) if k in a and k in b
                          else [f"{path}.{k}".lstrip(".") + " (in one only)"])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in diff_paths(x, y, f"{path}[{i}]")]
    if a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
        return []
    return [f"{path}: {json.dumps(a)[:120]} against {json.dumps(b)[:120]}"]


def manifest_doc(directory: Path, root: Path, stage: str) -> dict:
    """manifest.json without MANIFEST_EXCLUDED, its output root written as <root> (each trial has its own)."""
    doc = json.loads((directory / "manifest.json").read_text().replace(str(root), "<root>"))
    for key in MANIFEST_EXCLUDED["*"] + MANIFEST_EXCLUDED.get(stage, []):
        parent, _, leaf = key.rpartition(".") if "." in key else ("", "", key)
        node = doc.get(parent, {}) if parent else doc
        node.pop(leaf, None)
    return doc


def manifest_dirs(stage: str, root: Path) -> list[Path]:
    """Where the stage writes manifest.json (export: one per format folder)."""
    directory = stage_dir(root, stage)
    return sorted(p.parent for p in directory.glob("*/manifest.json")) if stage == "export" else [directory]


def compare_manifests(stage: str, ref_root: Path, root: Path) -> list[str]:
    ref_dirs, dirs = manifest_dirs(stage, ref_root), manifest_dirs(stage, root)
    diffs = []
    for ref, out in zip(ref_dirs, dirs):
        if not (out / "manifest.json").is_file():
            diffs.append(f"{out.relative_to(root)}/manifest.json: missing after the resume")
            continue
        ours, theirs = manifest_doc(out, root, stage), manifest_doc(ref, ref_root, stage)
        diffs += [f"manifest.json: {path}" for path in diff_paths(ours, theirs)]
    if len(ref_dirs) != len(dirs):
        diffs.append(f"manifests: {len(dirs)} after the resume, {len(ref_dirs)} in the reference")
    return diffs


def compare_stage(stage: str, ref_root: Path, root: Path) -> list[str]:
    ref, out = stage_dir(ref_root, stage), stage_dir(root, stage)
    if not out.is_dir():
        return [f"{out}: missing after the resume"]
    return COMPARE[stage](ref, out) + compare_manifests(stage, ref_root, root)


# ---------------------------------------------------------------------------------------------------------
# the campaign


def moments(stage: str, n: int, seed: int) -> list[float]:
    """n fractions in (0, 1), one in each n-th of the stage: spread over it, reproducible per stage."""
    rng = random.Random(f"{seed}:{stage}")
    return [(i + rng.random()) / n for i in range(n)]


def trial(stage: str, i: int, fraction: float, ref: dict, ctx: dict) -> dict:
    """Inputs copied from the reference, one kill at `fraction`, the rerun, the comparison."""
    root = ctx["work"] / "trials" / f"{stage}-{i:02d}"
    shutil.rmtree(root, ignore_errors=True)
    copy_inputs(ctx["reference"], root, stage)
    cmd, directory = stage_command(stage, root, ctx["overrides"]), stage_dir(root, stage)
    log = root / "logs" / "run.log"
    span = ref["last_write_s"] - ref["first_write_s"] if ctx["anchor"] == "write" else ref["duration_s"]
    for attempt in range(3):
        # Run times vary by +-40% on a shared machine: a run faster than the reference may end before a late
        # kill. Such a kill is retried (from fresh inputs) at the same fraction of the span that run took.
        moment = fraction * span
        result = {"kill": i, "fraction": round(fraction, 4), "moment_s": round(moment, 3), "attempts": attempt + 1,
                  **kill_at(cmd, ctx["env"], directory, log, moment, ctx["anchor"])}
        if result["outcome"] != "too_late" or attempt == 2:
            break
        span = result.pop("span_s")
        shutil.rmtree(root)
        copy_inputs(ctx["reference"], root, stage)
    result.pop("span_s", None)
    rc, seconds = run_to_end(cmd, ctx["env"], log, ctx["timeout_s"])
    result.update(resume_exit=rc, resume_s=round(seconds, 3), leftovers=temporaries(directory))
    result["differences"] = compare_stage(stage, ctx["reference"], root) if rc == 0 else \
        [f"the rerun failed (exit {rc}): {tail(log, 1500)}"]
    if not result["differences"] and not ctx["keep"]:
        shutil.rmtree(root)  # a failing trial's directory is kept for investigation
    else:
        result["dir"] = str(root)
    return result


def summarize(stage: str, ref: dict, trials: list[dict]) -> dict:
    count = {o: sum(t["outcome"] == o for t in trials)
             for o in ("too_late", "mid_write", "between_writes", "before_write", "failed_before_write")}
    return {"reference": ref, "kills": len(trials), **count,
            "resumed": sum(t["resume_exit"] == 0 for t in trials),
            "identical": sum(not t["differences"] for t in trials),
            "leftover_temporaries": sum(bool(t["leftovers"]) for t in trials),
            "trials": trials}


def report_trial(stage: str, n: int, t: dict) -> None:
    seen = f" ({', '.join(t['seen'][:3])})" if t["seen"] else ""
    verdict = "identical" if not t["differences"] else f"{len(t['differences'])} DIFFERENCES"
    print(f"[{stage} {t['kill'] + 1}/{n}] f={t['fraction']:.3f} +{t['moment_s']:.2f}s: {t['outcome']}{seen}"
          f" -> rerun exit {t['resume_exit']} in {t['resume_s']:.1f}s, {verdict}", flush=True)
    for line in t["differences"]:
        print(f"    {stage}: {line}", flush=True)
    if t["leftovers"]:
        print(f"    {stage}: temporaries left after the resume: {', '.join(t['leftovers'])}", flush=True)


def code_version() -> str:
    out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=REPO, capture_output=True,
                         text=True)
    return out.stdout.strip() or "unknown"


def machine() -> dict:
    from pipeline.precision import cpu_description  # torch: imported only where the machine is described

    return {"cpu": cpu_description(), "cores": len(os.sched_getaffinity(0)), "platform": platform.platform(),
            "python": platform.python_version(), "torch": importlib.metadata.version("torch"),
            "transformers": importlib.metadata.version("transformers")}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=10, help="kills per stage (default 10)")
    ap.add_argument("--stages", default=",".join(STAGES), help="comma-separated stages to kill (default all)")
    ap.add_argument("--tiny", action="store_true", help="the suite's tiny random Llama instead of SmolLM2")
    ap.add_argument("--target-dir", help="with --tiny: an existing tiny target directory (else built here)")
    ap.add_argument("--anchor", choices=("write", "start"), default="write",
                    help="measure kill moments from the stage's first write (default) or its start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", help="working directory (default: a new temporary one, removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep every trial's output root")
    ap.add_argument("--out", help="results JSON (default bench/results/faults.json, faults_tiny.json with --tiny)")
    args = ap.parse_args(argv)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(args.stages) - set(STAGES)
    if unknown or args.kills < 1:
        ap.error(f"unknown stages {sorted(unknown)}" if unknown else "--kills must be >= 1")
    if args.target_dir and not args.tiny:
        ap.error("--target-dir goes with --tiny")
    return args


def campaign(args: argparse.Namespace, work: Path) -> dict:
    env = child_env(args.tiny)
    if args.tiny:
        target = Path(args.target_dir) if args.target_dir else build_tiny_target(work / "tiny_target")
        overrides = TINY_OVERRIDES + [f"target.path={target}"]
    else:
        warm_target_cache(env)
        overrides = REAL_OVERRIDES
    ctx = {"work": work, "reference": work / "reference", "overrides": overrides, "env": env,
           "anchor": args.anchor, "keep": args.keep}
    t0, version = time.monotonic(), code_version()
    last = max(STAGES.index(s) for s in args.stages)
    refs = {}
    for stage in STAGES[:last + 1]:  # the chain up to the last stage killed: each stage's input and reference
        refs[stage] = run_reference(stage, stage_command(stage, ctx["reference"], overrides), env, ctx["reference"])
        print(f"[reference] {stage}: {refs[stage]['duration_s']:.1f}s (writes from {refs[stage]['first_write_s']:.2f}s "
              f"to {refs[stage]['last_write_s']:.2f}s)", flush=True)
    # A resume is never slower than a few reference runs; the timeout only catches a hung rerun.
    stages = {}
    for stage in args.stages:
        ctx["timeout_s"] = max(120.0, 10 * refs[stage]["duration_s"])
        trials = []
        for i, fraction in enumerate(moments(stage, args.kills, args.seed)):
            trials.append(trial(stage, i, fraction, refs[stage], ctx))
            report_trial(stage, args.kills, trials[-1])
        stages[stage] = summarize(stage, refs[stage], trials)
    return {"config": {"kills": args.kills, "stages": args.stages, "tiny": args.tiny, "anchor": args.anchor,
                       "seed": args.seed, "overrides": overrides, "command": stage_command("<stage>", Path("<root>"),
                                                                                           overrides)[1:],
                       "child_env": {k: env[k] for k in ("OMP_NUM_THREADS", "WANDB_MODE")},
                       "manifest_excluded": MANIFEST_EXCLUDED,
                       "code_version": {"start": version, "end": code_version()}},
            "machine": machine(), "wall_s": round(time.monotonic() - t0, 1), "stages": stages}


def write_results(out: Path, results: dict) -> None:
    """A campaign over some stages replaces those stages' entries in an existing results file of the same
    kind (tiny or not) and keeps the others, each entry with the configuration it was run with."""
    for s in results["stages"].values():
        s["run"] = {"config": results["config"], "wall_s": results["wall_s"]}
    if out.is_file():
        old = json.loads(out.read_text())
        if old.get("config", {}).get("tiny") == results["config"]["tiny"]:
            results["stages"] = {**{k: v for k, v in old["stages"].items() if k not in results["stages"]},
                                 **results["stages"]}
            results["stages"] = {k: results["stages"][k] for k in STAGES if k in results["stages"]}
    out.write_text(json.dumps(results, indent=1) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    default = "faults_tiny.json" if args.tiny else "faults.json"
    out = Path(args.out) if args.out else REPO / "bench" / "results" / default
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="eaglet-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    results = campaign(args, work)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_results(out, results)
    failed = False
    for stage, s in results["stages"].items():
        print(f"{stage}: {s['kills']} kills, {s['mid_write']} mid-write, {s['too_late']} too late, "
              f"{s['before_write']} before any write; {s['resumed']} resumed, {s['identical']} identical")
        failed |= s["identical"] < s["kills"]
    print(f"campaign: {results['wall_s']:.0f}s -> {out}")
    kept = any("dir" in t for s in results["stages"].values() for t in s["trials"])
    if not args.work and not args.keep and not kept:
        shutil.rmtree(work)
    elif kept or args.keep:
        print(f"trial directories kept under {work}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
