"""Runs every CPU benchmark one after another (never two at once: each one measures side by side inside
its own run, and two heavy jobs on 2 cores would distort both). Each writes bench/results/<name>.json."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

BENCHES = ["bench_regen.py", "bench_dump.py", "bench_ttt.py"]


def main() -> int:
    here = Path(__file__).resolve().parent
    failed = []
    for name in BENCHES:
        t0 = time.perf_counter()
        print(f"=== {name}", flush=True)
        rc = subprocess.call([sys.executable, str(here / name)], cwd=here.parent)
        print(f"=== {name}: exit {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
