"""`python -m pipeline.results save|has`: the command line of a results store (pipeline/eval/results_store.py),
which keeps a campaign's complete eval and train runs where `outputs/` does not last. `has` composes the eval's
config as pipeline.run does, so it asks for exactly the run that `stage=eval` with the same overrides writes:

    python -m pipeline.results save outputs/smollm2_quality_v2 results/smollm2_quality_v2
    python -m pipeline.results has results/smollm2_quality_v2 head=eagle3 eval.limit=40 experiment=smollm2_quality_v2
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.answers import compose
from pipeline.eval import results_store


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", required=True)
    s = sub.add_parser("save", help="copy an experiment folder's complete eval and train runs into the store")
    s.add_argument("experiment_dir", type=Path)
    s.add_argument("store", type=Path)
    h = sub.add_parser("has", help="exit 0 if the store holds the complete eval run these overrides name, else 1")
    h.add_argument("store", type=Path)
    h.add_argument("overrides", nargs="*", help="Hydra overrides, as for pipeline.run stage=eval")
    args = ap.parse_args(argv)
    if args.action == "save":
        print(json.dumps(results_store.save(args.experiment_dir, args.store)))
        return
    cfg = compose([o for o in args.overrides if not o.startswith("stage=")])
    head, run = cfg.eval_subject, cfg.eval_run_name
    found = results_store.kept_runs(args.store, head, run)
    print(f"{args.store}: eval/{head}/{run} {'kept' if run in found else 'not kept'}")
    sys.exit(0 if run in found else 1)


if __name__ == "__main__":
    main()
