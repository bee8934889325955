"""Committed results of a long campaign (jobs/quality_v2.sh): what a finished eval and train run leave that is small,
pickle-free and worth keeping when `outputs/` is gone, in the layout `pipeline.eval.table` reads, so a fresh machine
skips the runs already done and the tables are built from the store alone:

    <store>/eval/<head>/<run>/summary.json                  the eval's summary, as written
    <store>/eval/<head>/<run>/answers.partial.jsonl.gz      its per-turn records (the target's answers, no prompts)
    <store>/train/<head>/manifest.json                      the train manifest (counts, timings, final metrics,
                                                            the tau-selected step; never replaced by a machine
                                                            that only rebuilt the head from its carry)

Its command line is `python -m pipeline.results save|has` (pipeline/results.py).

Only complete runs are kept (an eval with summary.json, a train run with final/): a partial one reruns and resumes
from `outputs/` where the machine kept it. An eval is kept once, in the compute precision of the machine that ran it
(named in its run, `...-m256-bfloat16-tree...`): a machine whose `precision=auto` picks another one finds it kept
(`kept_as`), so a campaign that moves between CPUs never measures an eval twice. Gzip is written without a
timestamp and compared uncompressed, so saving twice changes no byte.
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Optional

from pipeline.eval.progress import PARTIAL
from pipeline.manifest import rebuilt_from
from pipeline.precision import DTYPES

# The precision segment of an eval run's name (EvalConfig's run name, pipeline/config.py `eval_run_name`):
# `<set>[-n<limit>]-T<temperature>-m<tokens>-<precision>-tree<k>x<depth>x<tokens>[...]`.
_PRECISION = re.compile(r"-(%s)-tree" % "|".join(DTYPES))


def _write_if_changed(dest: Path, data: bytes, gzipped: bool = False) -> bool:
    """Write `data` (gzipped into dest if `gzipped`) unless dest holds it already: compared uncompressed, so
    another zlib's bytes for the same records are no change."""
    if dest.is_file():
        held = gzip.decompress(dest.read_bytes()) if gzipped else dest.read_bytes()
        if held == data:
            return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.write_bytes(gzip.compress(data, compresslevel=9, mtime=0) if gzipped else data)
    tmp.replace(dest)
    return True


def save(experiment_dir: Path, store: Path) -> dict:
    """Copy every complete eval and train run of `experiment_dir` into `store`; returns what was written. A run's
    summary.json, the mark that the store holds it (`kept_runs`), is written after its answers."""
    experiment_dir, store = Path(experiment_dir), Path(store)
    written = {"eval": [], "train": []}
    for summary in sorted(experiment_dir.glob("eval/*/*/summary.json")):
        run = summary.parent
        rel = run.relative_to(experiment_dir)
        changed = False
        if (run / PARTIAL).is_file():
            changed = _write_if_changed(store / rel / f"{PARTIAL}.gz", (run / PARTIAL).read_bytes(), gzipped=True)
        changed |= _write_if_changed(store / rel / "summary.json", summary.read_bytes())
        if changed:
            written["eval"].append(str(rel))
    for manifest in sorted(experiment_dir.glob("train/*/manifest.json")):
        if not (manifest.parent / "final").is_dir():
            continue
        rel = manifest.parent.relative_to(experiment_dir)
        # A head rebuilt from its complete run's carry trained nothing here: the store keeps that run's own record
        # (its timings, machine and precision; the manifest a committed export names).
        if (store / rel / "manifest.json").is_file() and rebuilt_from(json.loads(manifest.read_text())):
            continue
        if _write_if_changed(store / rel / "manifest.json", manifest.read_bytes()):
            written["train"].append(str(rel))
    return written


def kept_runs(store: Path, head: str, run_prefix: str, tree: Optional[str] = None) -> list[str]:
    """The complete eval runs of `head` in the store whose name is `run_prefix` or starts with `run_prefix-`, and
    with `tree` (e.g. "10x6x60", or "10xautoxauto" for a tree eval chose) ends with `-tree<tree>`."""
    runs = []
    for summary in sorted((Path(store) / "eval" / head).glob("*/summary.json")):
        name = summary.parent.name
        if not (name == run_prefix or name.startswith(run_prefix + "-")):
            continue
        if tree is not None and not name.endswith(f"-tree{tree}"):
            continue
        if json.loads(summary.read_text()).get("complete", True):
            runs.append(name)
    return runs


def precision_of(run: str) -> Optional[str]:
    """The compute precision an eval run's name holds (`bfloat16` in `mt_bench-T0-m256-bfloat16-tree10x6x60`)."""
    found = _PRECISION.findall(run)
    return found[-1] if found else None


def without_precision(run: str) -> str:
    """An eval run's name with its precision segment blanked: the same eval on a machine of another precision."""
    precision = precision_of(run)
    if precision is None:
        return run
    head, tail = run.rsplit(f"-{precision}-tree", 1)
    return f"{head}-*-tree{tail}"


def kept_as(store: Path, head: str, run: str) -> Optional[str]:
    """The store's complete run of `head` that is the eval `run` names: `run` itself, else the same eval in another
    compute precision (the machine that ran it had another one); None if the store holds neither."""
    kept = kept_runs(store, head, run.rsplit("-T", 1)[0])
    if run in kept:
        return run
    same = [k for k in kept if without_precision(k) == without_precision(run)]
    return same[0] if same else None
