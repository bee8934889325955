"""Markdown table of every eval run of an experiment (complete or partial), for docs/results.md:

    python -m pipeline.eval.table outputs/smollm2_quality
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

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


if __name__ == "__main__":
    print(table(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/smollm2_quality")))
