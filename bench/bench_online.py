"""Online or offline? The demo head trained from a dump (dump + train) against online (train.source=online:
the target runs in the training job), for 1 and for 4 epochs, side by side in one run.

Both read the same regenerated conversations (the demo's regen output, made first if missing) and train
the same head with the same settings; only where the states come from differs. Timed is each stage's wall
time as a user pays it (target load included); the tau probe decodes are off (`train.tau_prompts=0`) since
they cost the same either way. Offline's dump is paid once, so its cost per epoch falls with epochs:

    python -m bench.bench_online            # ~9 minutes on 2 cores (regen included); writes bench/results/online.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_stage(root: Path, stage: str, *overrides: str) -> float:
    """`python -m pipeline.run` in its own process (as a user runs it); returns its wall seconds."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pipeline.run", f"stage={stage}", "experiment=demo",
                    f"output_root={root}", "wandb.mode=disabled", *overrides], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", default="1,4")
    ap.add_argument("--regen", help="a finished demo regen dir to reuse (else regenerated here)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "online.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="eaglet-bench-online-") as tmp:
        root = Path(tmp)
        if args.regen:
            (root / "demo").mkdir()
            (root / "demo" / "regen").symlink_to(Path(args.regen).resolve())
        else:
            run_stage(root, "regen")
        dump_s = run_stage(root, "dump")
        dump = json.loads((root / "demo" / "dump" / "manifest.json").read_text())
        rows = {}
        for epochs in (int(e) for e in args.epochs.split(",")):
            common = [f"train.epochs={epochs}", "train.tau_prompts=0", "train.plot=false"]
            train_s = run_stage(root, "train", f"head.name=offline-{epochs}", *common)
            online_s = run_stage(root, "train", f"head.name=online-{epochs}", "train.source=online", *common)
            metrics = {}
            for kind in ("offline", "online"):
                m = json.loads((root / "demo" / "train" / f"{kind}-{epochs}" / "manifest.json").read_text())
                metrics[kind] = {k: m["final_metrics"].get(k) for k in ("val/loss", "val/acc_0")}
            rows[str(epochs)] = {
                "offline_s": dump_s + train_s, "offline_dump_s": dump_s, "offline_train_s": train_s,
                "online_s": online_s, "online_over_offline": online_s / (dump_s + train_s),
                "final_metrics": metrics}
            print(f"{epochs} epoch(s): offline {dump_s:.0f} s dump + {train_s:.0f} s train = "
                  f"{dump_s + train_s:.0f} s; online {online_s:.0f} s ({online_s / (dump_s + train_s):.2f}x)",
                  flush=True)
    result = {"workload": {"experiment": "demo", "dump_tokens": dump["counts"].get("tokens")
                           or dump["totals"].get("tokens"), "dump_bytes": dump["totals"]["bytes"]},
              "epochs": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
