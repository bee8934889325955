"""Aggregate turn records into tau (official EAGLE definition), acceptance by depth, speedup; write the
summary, the plot and W&B."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

from pipeline.decoding.decoder import acceptance_rates, mean_accepted_tokens
from pipeline.eval.evaluate import TurnRecord


def _accept_lengths(records: Sequence[TurnRecord]) -> list[int]:
    return [a for r in records for a in r.accept_lengths]


def tau_of(records: Sequence[TurnRecord]) -> float:
    """tau over every verification forward of these turns (not a mean of per-turn taus)."""
    return mean_accepted_tokens(_accept_lengths(records))


def acceptance_by_depth(records: Sequence[TurnRecord], max_draft_len: int) -> list[float]:
    return acceptance_rates(_accept_lengths(records), max_draft_len)


def summarize(records: Sequence[TurnRecord], settings: dict, max_draft_len: int, loop_share: float = 0.5) -> dict:
    by_cat: dict[str, list[TurnRecord]] = defaultdict(list)
    for r in records:
        by_cat[r.category].append(r)
    spec_s = sum(r.wall_s for r in records)
    new_tokens = sum(r.new_tokens for r in records)
    step_s = {k: sum(getattr(r, f"{k}_s") for r in records) for k in ("target", "draft", "other")}
    summary = {
        "tau": tau_of(records),
        "tau_per_category": {c: tau_of(rs) for c, rs in sorted(by_cat.items())},
        "acceptance_by_depth": acceptance_by_depth(records, max_draft_len),
        "settings": settings,
        "turns": len(records),
        "new_tokens": new_tokens,
        "verification_forwards": sum(r.target_forwards for r in records),
        "spec_wall_s": spec_s,
        "spec_tokens_per_s": new_tokens / spec_s if spec_s else float("nan"),
        "time_fraction": {k: v / spec_s if spec_s else float("nan") for k, v in step_s.items()},
    }
    summary["tau_per_turn"] = {str(t + 1): tau_of([r for r in records if r.turn == t])
                               for t in sorted({r.turn for r in records})}
    summary.update(_baseline(records, settings.get("dtype", "float32")))
    if (check := greedy_check(records, settings.get("dtype", "float32"))) is not None:
        summary["greedy_check"] = check
    summary["looping"] = looping(records, loop_share)
    return summary


def greedy_check(records: Sequence[TurnRecord], precision: str) -> Optional[dict]:
    """What the T=0 check (evaluate.py, pipeline/decoding/ties.py) found over the turns it followed: how many
    stayed on the target's greedy path, tau over those (tau on the target's own path), and the partings, each a
    numerical tie of the precision (a parting above the bound failed the eval, unless the check was off)."""
    checked = [r for r in records if r.partings is not None]
    if not checked:
        return None
    on_path = [r for r in checked if not r.partings]
    partings = [p for r in checked for p in r.partings]
    return {"precision": precision, "turns": len(checked), "on_greedy_path": len(on_path),
            "tau_on_greedy_path": tau_of(on_path) if on_path else None,
            "partings": len(partings), "ties": sum(p["tie"] for p in partings),
            "largest_margin": max((p["margin"] for p in partings), default=None),
            "largest_margin_bound": max(partings, key=lambda p: p["margin"])["bound"] if partings else None}


def looping(records: Sequence[TurnRecord], share: float) -> dict:
    """Turns whose answer repeats itself (TurnRecord.repeat_share above `share`), and tau without them."""
    flagged = [r for r in records if r.repeat_share is not None and r.repeat_share > share]
    rest = [r for r in records if r not in flagged]
    return {"threshold": share, "turns": len(flagged), "flagged": [[r.question_id, r.turn + 1] for r in flagged],
            "tau_without": tau_of(rest) if rest else None}


def _baseline(records: Sequence[TurnRecord], precision: str) -> dict:
    """Speedup over the same turns both ways (the baseline may cover only the first questions), against
    vanilla decoding at its fastest precision on this machine, never a slowed-down baseline."""
    based = [r for r in records if r.baseline_wall_s is not None]
    if not based:
        return {}
    runs = {precision: (sum(r.baseline_new_tokens for r in based), sum(r.baseline_wall_s for r in based))}
    if all(r.fp32_baseline_wall_s is not None for r in based):
        runs["float32"] = (sum(r.fp32_baseline_new_tokens for r in based), sum(r.fp32_baseline_wall_s for r in based))
    rates = {p: tokens / wall for p, (tokens, wall) in runs.items()}
    fastest = max(rates, key=rates.get)
    spec_b = sum(r.wall_s for r in based)
    out = {"baseline_turns": len(based), "baseline_wall_s": runs[fastest][1], "baseline_precision": fastest,
           "baseline_tokens_per_s": rates[fastest], "baseline_tokens_per_s_by_precision": rates,
           "speedup": (sum(r.new_tokens for r in based) / spec_b) / rates[fastest]}
    checked = [r.matches_baseline for r in based if r.matches_baseline is not None]
    if checked:  # against vanilla at the target's own precision
        out["greedy_matches_baseline"] = f"{sum(checked)}/{len(checked)}"
        out["greedy_divergent_share"] = 1 - sum(checked) / len(checked)
    return out


def format_summary(summary: dict) -> str:
    s = summary["settings"]
    lines = [f"tau {summary['tau']:.3f}  (depth {s['depth']}, top_k {s['top_k']}, total_tokens "
             f"{s['total_tokens']}, T={s['temperature']:g}, {summary['turns']} turns, "
             f"{summary['new_tokens']} new tokens)"]
    if not summary.get("complete", True):
        lines.insert(0, f"PARTIAL: {summary['questions_done']} of {summary['questions']} questions "
                        "(rerun the same command to continue)")
    if "speedup" in summary:
        lines.append(f"speedup {summary['speedup']:.2f}x  (vanilla {summary['baseline_tokens_per_s']:.1f} tokens/s "
                     f"in {summary.get('baseline_precision', s.get('dtype'))}, the faster precision, over "
                     f"{summary['baseline_turns']} turns, {s['device']}; spec decoding in {s.get('dtype')})")
    if "greedy_check" in summary:
        g = summary["greedy_check"]
        line = (f"greedy check ({g['precision']}): {g['on_greedy_path']}/{g['turns']} turns identical to plain greedy "
                f"decoding")
        if g["partings"]:
            line += (f"; {g['partings']} partings, {g['ties']} within the tie bound (largest margin "
                     f"{g['largest_margin']:.3g}, its bound {g['largest_margin_bound']:.3g})")
        if g["tau_on_greedy_path"] is not None and g["on_greedy_path"] < g["turns"]:
            line += f"; tau on those turns {g['tau_on_greedy_path']:.3f}"
        lines.append(line)
    if len(summary.get("tau_per_turn", {})) > 1:
        lines.append("per turn: " + ", ".join(f"turn {t} {v:.2f}" for t, v in summary["tau_per_turn"].items()))
    if summary.get("looping", {}).get("turns"):
        lp = summary["looping"]
        lines.append(f"looping answers (repeated 4-gram share > {lp['threshold']:g}): {lp['turns']} turns; tau "
                     f"without them {lp['tau_without']:.3f}" if lp["tau_without"] is not None else
                     f"looping answers: all {lp['turns']} turns")
    lines.append("per category: " + ", ".join(f"{c} {t:.2f}" for c, t in summary["tau_per_category"].items()))
    lines.append("acceptance by depth: " + " ".join(f"{a:.2f}" for a in summary["acceptance_by_depth"]))
    tf = summary["time_fraction"]
    lines.append(f"decode time: target {tf['target']:.0%}, draft {tf['draft']:.0%}, other {tf['other']:.0%}")
    return "\n".join(lines)


def plot_summary(summary: dict, out_png: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    cats = list(summary["tau_per_category"])
    a.bar(cats, [summary["tau_per_category"][c] for c in cats])
    a.axhline(summary["tau"], color="k", linestyle="--", label=f"overall {summary['tau']:.2f}")
    a.set_title("tau per category")
    a.tick_params(axis="x", rotation=30)
    a.legend()
    acc = summary["acceptance_by_depth"]
    b.plot(range(1, len(acc) + 1), acc, marker="o")
    b.set_xlabel("draft depth d")
    b.set_ylim(0, 1)
    b.set_title("acceptance rate alpha_d")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def log_wandb(wandb_cfg, out_dir: Path, summary: dict, run_name: str, config: dict) -> Optional[str]:
    from pipeline.tracking import start_wandb_run

    run = start_wandb_run(wandb_cfg, out_dir, config, run_name, job_type="eval")
    if run is None:
        return None
    flat = {"eval/tau": summary["tau"], **{f"eval/tau_{c}": t for c, t in summary["tau_per_category"].items()},
            **{f"eval/alpha_{d + 1}": a for d, a in enumerate(summary["acceptance_by_depth"])}}
    if "speedup" in summary:
        flat["eval/speedup"] = summary["speedup"]
    run.log(flat)
    run.summary.update(flat)
    run.finish()
    return run.id
