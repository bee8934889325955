"""Does bf16 cost quality? The two comparisons of issue 18, on the demo experiment's data and head:

1. Dump precision: heads trained on an fp32 dump (seeds 0 and 1) and on a bf16 dump of the same rows (seed 0),
   same steps; their validation round-0 accuracy, next to the spread between the two fp32 seeds.
2. Target precision at eval: the fp32-dump seed-0 head decoded with an fp32 and with a bf16 target on the same
   MT-bench questions (T=0, tau only: eval.baseline=false), and the share of turns whose answers differ.

Every step is a `python -m pipeline.run` command under --root (each resumes or skips what is done), printed as
it runs; the results go to --out as JSON. About 25 minutes on the 2-core CPU.

    python -m bench.precision_quality --root outputs/precision --out bench/results/precision_quality.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MT_BENCH = "${data.root}/mt_bench/question.jsonl"


def run(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pipeline.run", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True, env={**os.environ, "WANDB_MODE": "disabled"})


def final_metrics(train_dir: Path) -> dict:
    return json.loads((train_dir / "manifest.json").read_text())["final_metrics"]


def answers(eval_dir: Path) -> list[str]:
    return [json.loads(line)["answer"] for line in (eval_dir / "answers.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=REPO / "outputs" / "precision")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "precision_quality.json")
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    root = args.root.resolve()
    common = ["experiment=demo", f"output_root={root}"]
    fp32, bf16 = ["name=prec_fp32"], ["name=prec_bf16"]

    run(["stage=regen", *common, *fp32])
    (root / "prec_bf16").mkdir(parents=True, exist_ok=True)
    shared_regen = root / "prec_bf16" / "regen"
    if not shared_regen.exists():  # the same conversations for both dumps
        shared_regen.symlink_to(root / "prec_fp32" / "regen")
    run(["stage=dump", *common, *fp32, "target.dtype=float32", "dump.dtype=float32"])
    run(["stage=dump", *common, *bf16, "target.dtype=bfloat16", "dump.dtype=bfloat16"])
    heads = {"fp32_dump_seed0": (fp32, 0), "fp32_dump_seed1": (fp32, 1), "bf16_dump_seed0": (bf16, 0)}
    for name, (exp, seed) in heads.items():
        run(["stage=train", *common, *exp, f"head.name={name}", f"train.seed={seed}"])
    acc = {name: final_metrics(root / exp[0].split("=")[1] / "train" / name)["val/acc_0"]
           for name, (exp, _) in heads.items()}

    taus, runs = {}, {}
    for dtype in ("float32", "bfloat16"):
        run(["stage=eval", *common, *fp32, "head.name=fp32_dump_seed0", f"target.dtype={dtype}",
             f"eval.questions={MT_BENCH}", f"eval.limit={args.questions}",
             f"eval.max_new_tokens={args.max_new_tokens}", "eval.baseline=false"])
        run_dir = max((root / "prec_fp32" / "eval" / "fp32_dump_seed0").glob(f"*-{dtype}-*"),
                      key=lambda p: p.stat().st_mtime)
        taus[dtype] = json.loads((run_dir / "summary.json").read_text())["tau"]
        runs[dtype] = run_dir
    a32, a16 = answers(runs["float32"]), answers(runs["bfloat16"])
    result = {
        "val_acc_0": acc,
        "fp32_seed_spread": abs(acc["fp32_dump_seed0"] - acc["fp32_dump_seed1"]),
        "bf16_minus_fp32_seed0": acc["bf16_dump_seed0"] - acc["fp32_dump_seed0"],
        "eval": {"questions": args.questions, "max_new_tokens": args.max_new_tokens, "tau": taus,
                 "tau_diff": taus["bfloat16"] - taus["float32"], "turns": len(a32),
                 "identical_answers": sum(x == y for x, y in zip(a32, a16))},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
