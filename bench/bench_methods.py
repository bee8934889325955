"""The method bench: vanilla decoding, prompt lookup, Medusa-1, EAGLE-1, EAGLE-3 and EAGLE-3 with the 3.1
options on one decoder harness, the same prompts and the same run (docs/results/methods.md).

A thin caller of the eval stage's comparison (`eval.compare`, pipeline/eval/compare.py): every method decodes
every turn of the same MT-bench questions (T=0) in a rotating order, each with the tree eval chooses for it on
this device (`tree.depth=-1 tree.total_tokens=-1`), a later turn's history being the vanilla answer. This script
names the methods, runs the comparison (it resumes: rerun to continue) and writes the table's JSON with the
machine it ran on, plus the tree each method would get if verification cost the same at every size.

The trained heads come from one experiment (default `smollm2_methods`, jobs/methods.sh trains them on one dump
with one budget).

    python -m bench.bench_methods                       # ~70 minutes on 2 CPU cores
    python -m bench.bench_methods --limit 2             # a smoke run
Writes bench/results/methods.json (or --out) and prints the table.
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from pipeline.config import EagletConfig
from pipeline.eval.config import EvalConfig, TreeConfig
from pipeline.eval.run import main as eval_main
from pipeline.manifest import TrainManifest
from pipeline.target import TargetConfig

REPO = Path(__file__).resolve().parents[1]

MT_BENCH = REPO.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
# Table rows: method name -> what eval.compare decodes (a head folder under <experiment>/train, or prompt_lookup).
METHODS = {"prompt_lookup": "prompt_lookup", "medusa": "medusa", "eagle1": "eagle1", "eagle3": "eagle3",
           "eagle3.1": "eagle3-31"}


def training_budget(train_dir: Path) -> dict:
    """What a head's training cost (from its train manifest): the methods compare at one budget."""
    m = TrainManifest.load(train_dir)
    return {"steps": m.counts.get("steps"), "train_s": m.timings.get("total_s"),
            "train": {k: m.config.get("train", {}).get(k) for k in
                      ("epochs", "lr", "schedule", "micro_batch_tokens", "warmup_steps", "seed")},
            "val": m.final_metrics}


def choice_if_verification_were_flat(choice: dict) -> dict:
    """The tree `choice`'s table would give if a verification forward cost the same for every size, as on a
    GPU far from its compute bound (a 135M target on an H200), drafting keeping its measured share: every
    (depth, N) re-timed with verify(N) = verify(smallest N)."""
    verify = {int(n): ms for n, ms in choice["verify_ms"].items()}
    flat, draft = min(verify.values()), choice["draft_ms_per_round"]
    best = max(choice["table"], key=lambda r: r["tokens_per_step"] / (draft * (r["depth"] + 2) + flat))
    return {"depth": best["depth"], "total_tokens": best["total_tokens"], "tokens_per_step": best["tokens_per_step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment", default="smollm2_methods")
    ap.add_argument("--output-root", default=str(REPO / "outputs"))
    ap.add_argument("--questions", default=str(MT_BENCH))
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="the methods' target precision (target.dtype)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of %(default)s")
    ap.add_argument("--report-only", action="store_true",
                    help="decode nothing more: the table of the turns the journal holds")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "methods.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    methods = {m: METHODS[m] for m in args.methods.split(",")}
    cfg = EagletConfig(name=args.experiment, output_root=args.output_root, target=TargetConfig(dtype=args.dtype),
                       eval=EvalConfig(questions=args.questions, limit=args.limit, max_new_tokens=args.max_new_tokens,
                                       compare=list(methods.values())),
                       tree=TreeConfig(depth=-1, total_tokens=-1))
    # --report-only: the summary the last run wrote (of every turn its journal held).
    summary = json.loads((cfg.stage_dir("eval") / "summary.json").read_text()) if args.report_only else eval_main(cfg)
    label = {subject: name for name, subject in methods.items()}
    rows = {label.get(k, k): v for k, v in summary["rows"].items()}
    trees = {label[k]: v for k, v in summary["tree_choices"].items()}
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                          "torch": torch.__version__},
              **{k: summary[k] for k in ("questions", "limit", "turns", "turns_by_index", "max_new_tokens",
                                         "temperature", "precision", "tree_choice_s")},
              "rows": rows, "tree_choices": trees,
              "methods": {label[k]: {**v, **({} if k == "prompt_lookup" else training_budget(
                  cfg.experiment_dir / "train" / k))} for k, v in summary["drafters"].items()},
              "table": summary["table"].replace("| eagle3-31 |", "| eagle3.1 |"),
              "tree_if_verification_were_flat": {m: choice_if_verification_were_flat(c) for m, c in trees.items()},
              "eval_dir": str(cfg.stage_dir("eval"))}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
