"""The suite's durations table for tests/README.md, from the log of a `pytest --durations=0` run.

    python -m tools.durations LOG [--top 40]     # markdown: the slowest tests, then the total per file

A test's time is its setup, call and teardown summed; a module-scoped fixture's cost lands in the setup of the
first test that uses it. With xdist workers the times are each worker's own, so the per-file totals add up to
more than the wall clock.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

LINE = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(.+?)\s*$")  # an id may hold spaces
SUMMARY = re.compile(r"^=+ (.*) in ([\d.]+)s")


def parse(log: str) -> tuple[Counter, str]:
    per_test: Counter = Counter()
    summary = ""
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            per_test[m.group(3)] += float(m.group(1))
        elif s := SUMMARY.search(line):
            summary = f"{s.group(1)} in {float(s.group(2)):.0f} s"
    return per_test, summary


def table(per_test: Counter, top: int) -> str:
    per_file: Counter = Counter()
    for test, seconds in per_test.items():
        per_file[test.split("::")[0]] += seconds
    rows = [f"| seconds | test ({top} slowest) |", "|---:|---|"]
    rows += [f"| {s:.1f} | `{t}` |" for t, s in per_test.most_common(top)]
    rows += ["", f"| seconds | file (all {len(per_file)}; {sum(per_file.values()):.0f} s in all) |", "|---:|---|"]
    rows += [f"| {s:.1f} | `{f}` |" for f, s in per_file.most_common()]
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    per_test, summary = parse(args.log.read_text(errors="replace"))
    if not per_test:
        print(f"{args.log}: no --durations lines (run pytest with --durations=0)", file=sys.stderr)
        return 1
    print(f"{summary}\n\n{table(per_test, args.top)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
