"""Markdown tables for docs/results/quality.md: every eval run of an experiment (complete or partial), then two heads
compared on the turns both have answered (a partial run is compared on its questions only), and the data-scaling
curve of heads trained on nested fractions of the data (`<kind>-f<fraction>`, the full-data head `<kind>`):

    python -m pipeline.eval.table outputs/smollm2_quality [eagle3 eagle1]
    python -m pipeline.eval.table outputs/smollm2_quality_v2 --scaling mt_bench-n40-T0-m128 --plot scaling.png
    python -m pipeline.eval.table results/smollm2_quality_v2 ...   # the same from a results store (results_store.py)
    python -m pipeline.eval.table results/smollm2_quality_v2 --ablations mt_bench-n20-T0-m128   # heads abl-*
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Optional

from pipeline.eval.evaluate import TurnRecord
from pipeline.eval.progress import PARTIAL, read_answers
from pipeline.eval.report import tau_of
from pipeline.eval.results_store import precision_of, without_precision

HEADER = ("| head | question set | T | precision | questions | turns | tau | tau turn 1 / 2 | greedy path | alpha_1..3 "
          "| speedup (CPU) | tokens/s spec / vanilla | tree (depth, top_k, tokens) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def eval_summaries(experiment_dir: Path) -> list[tuple[str, str, dict]]:
    """(head, run name, summary) for eval/<head>/<run>/summary[.partial].json, sorted by head then run."""
    found = []
    for run in sorted((Path(experiment_dir) / "eval").glob("*/*")):
        for name in ("summary.json", "summary.partial.json"):
            if (run / name).exists():
                found.append((run.parent.name, run.name, json.loads((run / name).read_text())))
                break
    return found


def tree_shape(t: dict) -> str:
    """A tree as the tables write it: "depth, top_k, total_tokens" (a run's settings or eval's tree_choice)."""
    return f"{t['depth']}, {t['top_k']}, {t['total_tokens']}"


def row(head: str, run: str, s: dict) -> str:
    st = s["settings"]
    done = f"{s.get('questions_done', '?')}/{s.get('questions', '?')}"
    done += "" if s.get("complete", True) else " (partial)"
    alpha = " ".join(f"{a:.2f}" for a in s["acceptance_by_depth"][:3])
    speed = f"{s['speedup']:.2f}x ({s.get('baseline_turns', s['turns'])} turns)" if "speedup" in s else "-"
    rates = f"{s['spec_tokens_per_s']:.1f}"
    rates += f" / {s['baseline_tokens_per_s']:.1f}" if "baseline_tokens_per_s" in s else ""
    c = s.get("tree_choice")  # (tree.depth/total_tokens=-1: the tree eval chose on this device)
    tree = f"chosen: {tree_shape(c)}" if c else tree_shape(st)
    turns = s.get("tau_per_turn", {})
    by_turn = " / ".join(f"{turns[t]:.2f}" for t in ("1", "2") if t in turns) if len(turns) > 1 else "-"
    precision = st.get("dtype") or precision_of(run) or "?"
    return (f"| {head} | {run.rsplit('-T', 1)[0]} | {st['temperature']:g} | {precision} | {done} | "
            f"{s['turns']} | **{s['tau']:.2f}** | {by_turn} | {greedy_path(s)} | {alpha} | {speed} | {rates} | "
            f"{tree} |")


def greedy_path(s: dict) -> str:
    """A run's greedy-identity count: turns identical to plain greedy decoding of the checked ones, with the
    partings that were ties (T=0); '-' for sampling or a run that checked nothing."""
    g = s.get("greedy_check")
    if g is None:
        return f"{s['greedy_matches_baseline']}, partings unchecked" if "greedy_matches_baseline" in s else "-"
    ties = f", {g['ties']} tie{'s' * (g['ties'] != 1)}" if g["partings"] else ""
    return f"{g['on_greedy_path']}/{g['turns']}{ties}"


def table(experiment_dir: Path) -> str:
    rows = [row(*found) for found in eval_summaries(experiment_dir)]
    return "\n".join([HEADER, *rows])


def answers_file(run_dir: Path) -> Optional[Path]:
    """The run's resumable answers file, or its gzipped copy in a results store; None if it has neither."""
    for path in (run_dir / PARTIAL, run_dir / f"{PARTIAL}.gz"):
        if path.is_file():
            return path
    return None


def turn_records(run_dir: Path) -> dict[tuple[str, int], TurnRecord]:
    """(question id, turn) -> record, from the run's resumable answers file (complete or partial)."""
    path = answers_file(run_dir)
    if path is None:
        raise FileNotFoundError(f"{run_dir}: no {PARTIAL} (or .gz): no per-turn records to read")
    _, done, _ = read_answers(path)
    return {(r.question_id, r.turn): r for records in done.values() for r in records}


def comparison(experiment_dir: Path, a: str = "eagle3", b: str = "eagle1") -> str:
    """tau of heads a and b on the turns both answered, per eval both heads have, and a / b. An eval is paired by
    its run name, else with the same eval in another compute precision (each run in its machine's; the precision
    column names both)."""
    rows = [f"| question set | T | tree | precision | turns both answered | tau {a} | tau {b} | {a} / {b} (95% CI) |",
            "|---|---|---|---|---|---|---|---|"]
    eval_dir = Path(experiment_dir) / "eval"
    for run_a in sorted((eval_dir / a).glob("*")):
        run_b = eval_dir / b / run_a.name
        if not run_b.is_dir():
            same = [r for r in sorted((eval_dir / b).glob("*"))
                    if without_precision(r.name) == without_precision(run_a.name)]
            run_b = same[0] if same else run_b
        if not (answers_file(run_a) and answers_file(run_b)):
            continue
        ra, rb = turn_records(run_a), turn_records(run_b)
        shared = sorted(ra.keys() & rb.keys())
        if not shared:
            continue
        ta, tb = tau_of([ra[k] for k in shared]), tau_of([rb[k] for k in shared])
        name, rest = run_a.name.rsplit("-T", 1)
        temp = rest.split("-", 1)[0]  # <set>[-n<limit>]-T<temperature>-m<tokens>-<precision>-tree<k>x<d>x<n>
        low, high = paired_tau_ci(ra, rb, ratio=True)
        precision = " / ".join(dict.fromkeys(str(precision_of(r.name) or "-") for r in (run_a, run_b)))
        rows.append(f"| {name} | {temp} | {_tree_of(run_a.name)} | {precision} | {len(shared)} | {ta:.2f} | {tb:.2f} "
                    f"| **{ta / tb:.2f}** ({low:.2f}, {high:.2f}) |")
    return "\n".join(rows)


def _tree_of(run: str) -> str:
    """The tree an eval run's name holds (`-tree<top_k>x<depth>x<tokens>`), as the tables write it; "chosen" for a
    tree eval chose on its machine (`-tree10xautoxauto`), "-" for a name without one."""
    if "-tree" not in run:
        return "-"
    top_k, depth, total = (run.rsplit("-tree", 1)[1].split("-")[0].split("x") + ["?", "?"])[:3]
    return "chosen" if depth == "auto" else f"{depth}, {top_k}, {total}"


def paired_taus(ra: dict, rb: dict, resamples: int = 2000, seed: int = 0):
    """Bootstrap draws [resamples, 2] of (tau(a), tau(b)) over the turns both answered, resampling questions for both
    at once (both heads decode the same prompts, and greedy speculative decoding gives the same answers); None
    without a shared question."""
    import numpy as np

    by_q: dict = {}
    for key in ra.keys() & rb.keys():
        acc = by_q.setdefault(key[0], np.zeros(4))
        for i, r in enumerate((ra[key], rb[key])):
            acc[2 * i] += sum(r.accept_lengths)  # tokens accepted over its verification forwards
            acc[2 * i + 1] += len(r.accept_lengths)
    if not by_q:
        return None
    sums = np.stack([by_q[q] for q in sorted(by_q)])  # [questions, (a accepted, a forwards, b accepted, b forwards)]
    picks = np.random.default_rng(seed).integers(0, len(sums), size=(resamples, len(sums)))
    totals = sums[picks].sum(axis=1)  # [resamples, 4]
    # tau counts each forward's own token too: 1 + accepted per forward.
    return np.stack([1 + totals[:, 0] / totals[:, 1], 1 + totals[:, 2] / totals[:, 3]], axis=1)


def paired_tau_ci(ra: dict, rb: dict, ratio: bool = False) -> Optional[tuple[float, float]]:
    """95% interval of tau(a) - tau(b), or of tau(a) / tau(b) with `ratio` (paired_taus); None without a shared
    question."""
    import numpy as np

    draws = paired_taus(ra, rb)
    if draws is None:
        return None
    stat = draws[:, 0] / draws[:, 1] if ratio else draws[:, 0] - draws[:, 1]
    low, high = np.quantile(stat, [0.025, 0.975])
    return float(low), float(high)


SCALED_HEAD = re.compile(r"^(?P<kind>[a-z0-9_]+?)(?:-f(?P<fraction>[0-9]*\.?[0-9]+))?$")


def scaling_points(experiment_dir: Path, run_prefix: str, kinds=("eagle3", "eagle1")) -> dict:
    """{(fraction, tree): {kind: summary}} from the eval runs named `run_prefix`* of the heads `<kind>-f<fraction>`
    and `<kind>` (fraction 1), kind in `kinds`; tree is "depth, top_k, total_tokens", or "chosen" for a run whose
    tree eval chose for its head on this device (tree.depth/total_tokens=-1: each head's own)."""
    points: dict = {}
    for head, run, s in eval_summaries(experiment_dir):
        m = SCALED_HEAD.match(head)
        if not m or m["kind"] not in kinds or not (run == run_prefix or run.startswith(run_prefix + "-")):
            continue
        st = s["settings"]
        tree = "chosen" if "tree_choice" in s else tree_shape(st)
        key = (float(m["fraction"] or 1), tree)
        if m["kind"] in points.get(key, {}):
            raise ValueError(f"{experiment_dir}/eval/{head}: two runs named {run_prefix}* with tree {tree} "
                             f"(another dtype?): give a longer run name prefix")
        points.setdefault(key, {})[m["kind"]] = {**s, "_run_dir": Path(experiment_dir) / "eval" / head / run}
    return dict(sorted(points.items()))


def scaling(experiment_dir: Path, run_prefix: str, a: str = "eagle3", b: str = "eagle1",
            plot: Optional[Path] = None) -> str:
    """The scaling table: tau of heads a and b at each data fraction and tree, and a / b, with the checkpoint each head
    is (train.select=tau: the step of the best decoded tau, of the last step); with `plot`, tau against the fraction
    drawn there (one line per head and tree)."""
    points = scaling_points(experiment_dir, run_prefix, (a, b))
    rows = [f"| data fraction | tree (depth, top_k, tokens) | questions | tau {a} | tau {b} | {a} / {b} (95% CI) "
            f"| checkpoint {a} / {b} |", "|---|---|---|---|---|---|---|"]
    for (fraction, tree), heads in points.items():
        sa, sb = heads.get(a), heads.get(b)
        first = sa or sb
        ratio = f"**{sa['tau'] / sb['tau']:.2f}**" if sa and sb else "-"
        if sa and sb and answers_file(sa["_run_dir"]) and answers_file(sb["_run_dir"]):
            ci = paired_tau_ci(turn_records(sa["_run_dir"]), turn_records(sb["_run_dir"]), ratio=True)
            ratio += f" ({ci[0]:.2f}, {ci[1]:.2f})" if ci else ""
        suffix = "" if fraction == 1 else f"-f{fraction:g}"
        chosen = " / ".join(_checkpoint_cell(experiment_dir, kind + suffix) for kind in (a, b))
        rows.append(f"| {fraction:g} | {tree} | {first.get('questions_done', '?')}/"
                    f"{first.get('questions', '?')} | {_tau_cell(sa)} | {_tau_cell(sb)} | {ratio} | {chosen} |")
    if plot is not None:
        _plot_scaling(points, (a, b), Path(plot))
    return "\n".join(rows)


def _checkpoint_cell(experiment_dir: Path, head: str) -> str:
    """Which step the head's final/ is: "last" (train.select=last, or the best tau was the last probe's), or
    "<step> of <last>" when an earlier checkpoint decoded the best tau; "-" without a train manifest."""
    path = Path(experiment_dir) / "train" / head / "manifest.json"
    if not path.is_file():
        return "-"
    selected = json.loads(path.read_text()).get("selected")
    if not selected or selected["step"] == selected.get("last_step"):
        return "last"
    return f"{selected['step']} of {selected['last_step']}"


def _tau_cell(summary: Optional[dict]) -> str:
    """A scaling table cell: the run's tau, and the chosen tree's shape beside it."""
    if not summary:
        return "-"
    c = summary.get("tree_choice")
    return f"{summary['tau']:.2f}" + (f" ({tree_shape(c)})" if c else "")


def _plot_scaling(points: dict, kinds, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for tree in sorted({tree for _, tree in points}):
        for kind in kinds:
            xs = [(f, heads[kind]["tau"]) for (f, t), heads in points.items() if t == tree and kind in heads]
            if xs:
                ax.plot(*zip(*xs), marker="o", label=f"{kind}, tree {tree}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("fraction of the training data")
    ax.set_ylabel("tau (MT-bench)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _recipe(manifest: dict) -> str:
    """The choices an ablation row varies, from its train manifest: schedule, TTT rounds, draft vocabulary (asked and
    built), lm_head start, and whose answers it trained on."""
    train, head, dump = (manifest["config"].get(k, {}) for k in ("train", "head", "dump"))
    schedule = train.get("schedule", "?") + (f" to {train['min_lr_ratio']:g}" if train.get("min_lr_ratio") else "")
    vocab = head.get("draft_vocab_size")
    built = manifest.get("counts", {}).get("draft_vocab_size", vocab)
    vocab_cell = f"{vocab}" if built == vocab else f"{vocab} ({built} seen)"
    answers = "dataset's" if dump.get("input") == "data" else "regenerated"
    return (f"{schedule}, TTT {head.get('ttt_steps', '-')}, vocab {vocab_cell}, "
            f"lm_head {head.get('lm_head_init', '-')}, {answers}")


def ablations(experiment_dir: Path, run_prefix: str, prefix: str = "abl-", base: str = "base") -> str:
    """The ablation table: one row per head `<prefix><name>` with a train manifest, its recipe, training rows and
    tokens, validation round-0 accuracy and the tau of its eval run named `run_prefix`*, against the `base` row."""
    experiment_dir = Path(experiment_dir)
    taus: dict = {}
    for head, run, s in eval_summaries(experiment_dir):
        if head.startswith(prefix) and (run == run_prefix or run.startswith(run_prefix + "-")):
            if head in taus:
                raise ValueError(f"{experiment_dir}/eval/{head}: two runs named {run_prefix}* (another dtype or "
                                 f"tree?): give a longer run name prefix")
            taus[head] = {**s, "_run_dir": experiment_dir / "eval" / head / run}
    rows = ["| ablation | recipe | train rows | tokens per epoch | steps | val acc_0 | tau | tau - base (95% CI) |",
            "|---|---|---|---|---|---|---|---|"]
    ref = taus.get(prefix + base)
    ref_records = turn_records(ref["_run_dir"]) if ref and answers_file(ref["_run_dir"]) else None
    for path in sorted((experiment_dir / "train").glob(f"{prefix}*/manifest.json")):
        head = path.parent.name
        m = json.loads(path.read_text())
        c, fm, s = m.get("counts", {}), m.get("final_metrics", {}), taus.get(head)
        tokens = f"{c['train_tokens']:,}" if "train_tokens" in c else "-"
        acc = f"{fm['val/acc_0']:.3f}" if "val/acc_0" in fm else "-"
        delta = f"{s['tau'] - ref['tau']:+.2f}" if s and ref else "-"
        if s and ref_records and head != prefix + base and answers_file(s["_run_dir"]):
            ci = paired_tau_ci(turn_records(s["_run_dir"]), ref_records)
            delta += f" ({ci[0]:+.2f}, {ci[1]:+.2f})" if ci else ""
        rows.append(f"| {head[len(prefix):]} | {_recipe(m)} | {c.get('train_rows', '-')} | {tokens} | "
                    f"{c.get('steps', '-')} | {acc} | {_tau_cell(s)} | {delta} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment_dir", nargs="?", default="outputs/smollm2_quality", type=Path)
    ap.add_argument("heads", nargs="*", default=["eagle3", "eagle1"], help="the two heads compared")
    ap.add_argument("--scaling", metavar="RUN_PREFIX", help="the scaling table of the eval runs named RUN_PREFIX*")
    ap.add_argument("--plot", type=Path, help="with --scaling: draw tau against the data fraction here")
    ap.add_argument("--ablations", metavar="RUN_PREFIX", help="the ablation table of the heads abl-*, by their eval "
                                                              "runs named RUN_PREFIX*")
    args = ap.parse_args(argv)
    a, b = (args.heads + ["eagle3", "eagle1"][len(args.heads):])[:2]  # one head named: against eagle1
    if args.scaling:
        print(scaling(args.experiment_dir, args.scaling, a, b, args.plot))
        return
    if args.ablations:
        print(ablations(args.experiment_dir, args.ablations))
        return
    print(table(args.experiment_dir))
    print()
    print(comparison(args.experiment_dir, a, b))


if __name__ == "__main__":
    main()
