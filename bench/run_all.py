"""Runs every CPU benchmark one after another (never two at once: each one measures side by side inside
its own run, and two heavy jobs on 2 cores would distort both). Each writes bench/results/<name>.json.

    python -m bench.run_all        # from the repository root (`make bench`)"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# bench_stages: every stage's variants (regen engines, fp32 against bf16); ~3-4 hours on 2 cores, resumable
# with `--work`. bench_ttt: the TTT training forward against the reference. bench_online: online training
# against dump + train, for 1 and 4 epochs (~10 minutes).
BENCHES = ["bench.bench_stages", "bench.bench_ttt", "bench.bench_online"]


def main() -> int:
    failed = []
    for name in BENCHES:
        t0 = time.perf_counter()
        print(f"=== {name}", flush=True)
        rc = subprocess.call([sys.executable, "-m", name], cwd=REPO)
        print(f"=== {name}: exit {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
