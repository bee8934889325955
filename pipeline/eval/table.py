"""Markdown tables for docs/results/quality.md: every eval run of an experiment (complete or partial), then two heads
compared on the turns both have answered (a partial run is compared on its questions only):

    python -m pipeline.eval.table outputs/smollm2_quality [eagle3 eagle1]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.eval.evaluate import TurnRecord
from pipeline.eval.progress import PARTIAL, read_answers
from pipeline.eval.report import tau_of

HEADER = ("| head | question set | T | questions | turns | tau | alpha_1..3 | speedup (CPU) | tokens/s spec / vanilla "
          "| tree (depth, top_k, tokens) |\n|---|---|---|---|---|---|---|---|---|---|")


def eval_summaries(experiment_dir: Path) -> list[tuple[str, str, dict]]:
    """(head, run name, summary) for eval/<head>/<run>/summary[.partial].json, sorted by head then run."""
    found = []
    for run in sorted((Path(experiment_dir) / "eval").glob("*/*")):
        for name in ("summary.json", "summary.partial.json"):
            if (run / name).exists():
                found.append((run.parent.name, run.name, json.loads((run / name).read_text())))
                break
    return found


def row(head: str, run: str, s: dict) -> str:
    st = s["settings"]
    done = f"{s.get('questions_done', '?')}/{s.get('questions', '?')}"
    done += "" if s.get("complete", True) else " (partial)"
    alpha = " ".join(f"{a:.2f}" for a in s["acceptance_by_depth"][:3])
    speed = f"{s['speedup']:.2f}x ({s.get('baseline_turns', s['turns'])} turns)" if "speedup" in s else "-"
    rates = f"{s['spec_tokens_per_s']:.1f}"
    rates += f" / {s['baseline_tokens_per_s']:.1f}" if "baseline_tokens_per_s" in s else ""
    tree = f"{st['depth']}, {st['top_k']}, {st['total_tokens']}"
    return (f"| {head} | {run.rsplit('-T', 1)[0]} | {st['temperature']:g} | {done} | {s['turns']} | "
            f"**{s['tau']:.2f}** | {alpha} | {speed} | {rates} | {tree} |")


def table(experiment_dir: Path) -> str:
    rows = [row(*found) for found in eval_summaries(experiment_dir)]
    return "\n".join([HEADER, *rows])


def turn_records(run_dir: Path) -> dict[tuple[str, int], TurnRecord]:
    """(question id, turn) -> record, from the run's resumable answers file (complete or partial)."""
    _, done, _ = read_answers(run_dir / PARTIAL)
    return {(r.question_id, r.turn): r for records in done.values() for r in records}


def comparison(experiment_dir: Path, a: str = "eagle3", b: str = "eagle1") -> str:
    """tau of heads a and b on the turns both answered, per eval run name both heads have, and a / b."""
    rows = [f"| question set | T | turns both answered | tau {a} | tau {b} | {a} / {b} |", "|---|---|---|---|---|---|"]
    eval_dir = Path(experiment_dir) / "eval"
    for run_a in sorted((eval_dir / a).glob("*")):
        run_b = eval_dir / b / run_a.name
        if not ((run_a / PARTIAL).exists() and (run_b / PARTIAL).exists()):
            continue
        ra, rb = turn_records(run_a), turn_records(run_b)
        shared = sorted(ra.keys() & rb.keys())
        if not shared:
            continue
        ta, tb = tau_of([ra[k] for k in shared]), tau_of([rb[k] for k in shared])
        name, rest = run_a.name.rsplit("-T", 1)
        temp = rest.split("-", 1)[0]  # <set>[-n<limit>]-T<temperature>-m<tokens>-<precision>-tree<k>x<d>x<n>
        rows.append(f"| {name} | {temp} | {len(shared)} | {ta:.2f} | {tb:.2f} | **{ta / tb:.2f}** |")
    return "\n".join(rows)


if __name__ == "__main__":
    exp = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/smollm2_quality")
    print(table(exp))
    print()
    print(comparison(exp, *sys.argv[2:4]))
