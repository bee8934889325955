"""`eval.compare=[prompt_lookup,eagle3,...]`: several drafters decoded side by side on the same turns in one run,
against the same vanilla decoding (outputs/<experiment>/eval/compare/<run>/).

Every drafter decodes every turn of the same questions, one turn at a time in a rotating order, so a slow spell
of the machine hits all of them alike. With `tree.depth=-1 tree.total_tokens=-1` each drafter gets the tree eval
chooses for it on this device (autotree.py, from its own calibration decodes), kept in trees.json. A later
turn's history is the vanilla answer, so every drafter sees the same prompts even where bf16 numerical ties make
one part from vanilla's. On a CPU with a reduced-precision target the fp32 copy's vanilla decoding is timed too
while it may be the faster one (`fp32_vanilla_pays`); speedup is over the fastest vanilla.

Each finished turn goes to turns.jsonl; a rerun continues after the last one. Per drafter the summary holds
tau, alpha_1..3 (P(draft d accepted | drafts before it accepted)), tokens/s, speedup, the drafting share of the
wall time and how many turns equal vanilla decoding token for token. Where a drafter's answer parts from vanilla's,
the step is held to the precision's tie bound (pipeline/decoding/ties.py): a parting above it fails the run."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from pipeline.data.bad_records import BadRecordReport
from pipeline.data.chat import render_prompt, stop_token_ids
from pipeline.decoding.decoder import acceptance_rates, follow_greedy, generate, vanilla_generate
from pipeline.decoding.ties import GreedyPathError, Parting
from pipeline.decoding.tree import TreeSpec
from pipeline.eval.evaluate import off_greedy_path, system_messages
from pipeline.eval.questions import load_questions
from pipeline.eval.subjects import build_drafter, fp32_baseline_model, tree_choice
from pipeline.files import atomic_write_text, text_lines
from pipeline.manifest import to_plain, write_manifest
from pipeline.target import load_target

log = logging.getLogger(__name__)
JOURNAL, TREES, RUN = "turns.jsonl", "trees.json", "run.json"


def main(cfg) -> dict:
    """The comparison of `cfg.eval.compare` (see the module doc). Returns the summary (also summary.json)."""
    t0 = time.perf_counter()
    if cfg.target.tensor_parallel > 1:
        raise ValueError("eval.compare decodes on one target process: run it with target.tensor_parallel=1")
    if cfg.eval.temperature != 0:
        raise ValueError("eval.compare measures greedy decoding (eval.temperature=0): the turns equal vanilla's "
                         "token for token there, which is what makes them comparable")
    out_dir = cfg.stage_dir("eval")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = load_target(cfg.target)
    names = list(cfg.eval.compare)
    built = {name: build_drafter(cfg, target, name) for name in names}
    report = BadRecordReport()
    questions = load_questions(cfg.eval.questions, cfg.eval.limit, report, cfg.data.on_bad_record,
                               cfg.data.max_turn_chars)
    _claim(out_dir, {"compare": names, "questions": [q.id for q in questions], "seed": cfg.eval.seed,
                     "temperature": cfg.eval.temperature, "max_new_tokens": cfg.eval.max_new_tokens,
                     "precision": target.precision, "system_prompt": cfg.data.system_prompt,
                     "drafters": {n: info for n, (_, info, _) in built.items()}}, cfg.eval.overwrite)
    trees = {}
    for name, (drafter, _, _) in built.items():
        if cfg.tree.is_auto:
            trees[name] = tree_choice(cfg, target, drafter, questions, out_dir, resumed=True,
                                      name=f"tree_choice.{name}.json")
        else:
            trees[name] = {"top_k": cfg.tree.top_k, "depth": cfg.tree.depth, "total_tokens": cfg.tree.total_tokens}
    choice_s = time.perf_counter() - t0
    turns = decode_turns(cfg, target, {n: (d, trees[n]) for n, (d, _, _) in built.items()}, questions, out_dir)
    rows = aggregate(turns, names, trees)
    summary = {"compare": names, "questions": cfg.eval.questions or "demo", "limit": cfg.eval.limit,
               "turns": len(turns), "turns_by_index": {str(i + 1): sum(t["turn"] == i for t in turns)
                                                        for i in range(max((len(q.turns) for q in questions),
                                                                           default=0))},
               "max_new_tokens": cfg.eval.max_new_tokens, "temperature": 0, "precision": target.precision,
               "device": str(target.device), "tree_choice_s": choice_s, "rows": rows, "table": markdown(rows),
               "drafters": {n: info for n, (_, info, _) in built.items()}, "tree_choices": trees,
               "target": target.fingerprint}
    atomic_write_text(out_dir / "summary.json", json.dumps(to_plain(summary), indent=2) + "\n")
    write_manifest(out_dir, "eval", config={"eval": cfg.eval, "tree": cfg.tree, "target": cfg.target},
                   counts={"questions": len(questions), "turns": len(turns), "bad_records": report.to_dict()},
                   timings={"total_s": time.perf_counter() - t0},
                   inputs=[p for _, _, dirs in built.values() for p in dirs], target=target.fingerprint,
                   precision=target.precision)
    print(f"[eval] {cfg.name}/compare/{cfg.eval_run_name} -> {out_dir}\n{summary['table']}")
    return summary


def _claim(out_dir: Path, identity: dict, overwrite: bool) -> None:
    """Binds the folder to this comparison: a journal of other settings is refused (or, with overwrite, dropped)."""
    path = out_dir / RUN
    identity = json.loads(json.dumps(identity, sort_keys=True, default=str))
    if path.is_file() and json.loads(path.read_text()) != identity:
        if not overwrite:
            theirs = json.loads(path.read_text())
            diff = sorted(k for k in set(theirs) | set(identity) if theirs.get(k) != identity.get(k))
            raise ValueError(f"{out_dir}: holds a comparison with other {', '.join(diff)}; rerun with "
                             f"eval.overwrite=true to discard it, or set eval.run_name")
        for stale in out_dir.glob("*"):
            if stale.is_file():
                stale.unlink()
    atomic_write_text(path, json.dumps(identity, indent=1, sort_keys=True) + "\n")


def decode_turns(cfg, target, variants: dict, questions, out_dir: Path) -> list[dict]:
    """Every turn of every question decoded by vanilla decoding and each variant (name -> (drafter, tree dict)),
    turn-major (every question's first turn, then every second turn), continuing the journal."""
    journal = out_dir / JOURNAL
    done = [json.loads(line) for line in text_lines(journal.read_text(encoding="utf-8"))] if journal.is_file() else []
    answers = {(t["question_id"], t["turn"]): t["vanilla_answer"] for t in done}
    eos = set(stop_token_ids(target.tokenizer, target.model))
    fp32_model = fp32_baseline_model(cfg, target)
    deadline = None if cfg.eval.time_budget_s is None else time.monotonic() + cfg.eval.time_budget_s
    for ti in range(max((len(q.turns) for q in questions), default=0)):
        for q in (q for q in questions if ti < len(q.turns) and (q.id, ti) not in answers):
            messages = system_messages(q)
            for tj in range(ti):
                messages += [{"role": "user", "content": q.turns[tj]},
                             {"role": "assistant", "content": answers[(q.id, tj)]}]
            messages.append({"role": "user", "content": q.turns[ti]})
            prompt = torch.tensor(render_prompt(target.tokenizer, messages, system_prompt=cfg.data.system_prompt,
                                                thinking=cfg.regen.thinking))
            fp32 = fp32_model if fp32_vanilla_pays(done) else None
            record, base = decode_turn(target, fp32, variants, prompt, cfg.eval.max_new_tokens, eos, len(done))
            for r in record.values():
                if (p := r.get("parting")) is not None and not p["tie"]:
                    p = Parting(**{k: v for k, v in p.items() if k != "tie"})
                    raise GreedyPathError(off_greedy_path(q, ti, p, target.tokenizer, target.model.dtype))
            answers[(q.id, ti)] = target.tokenizer.decode(base, skip_special_tokens=True).strip()
            entry = {"question_id": q.id, "turn": ti, "category": q.category, "prompt_tokens": len(prompt),
                     "vanilla_answer": answers[(q.id, ti)], **record}
            with journal.open("a") as f:
                f.write(json.dumps(entry) + "\n")
            done.append(entry)
            log.info("[%d] q%s turn %d: %s", len(done), q.id, ti + 1, "  ".join(
                f"{name} {r['tokens'] / r['wall_s']:.1f}" for name, r in record.items()))
            if deadline is not None and time.monotonic() > deadline:  # as eval: stop after the turn that crossed it
                log.info("eval time budget spent after %d turns", len(done))
                return done
    return done


def decode_turn(target, fp32_model, variants: dict, prompt: torch.Tensor, max_new_tokens: int, eos,
                rotation: int) -> tuple[dict, list[int]]:
    """Vanilla decoding (and its fp32 copy's) and every variant on one prompt, in an order rotated by `rotation`
    -> per-variant record, vanilla's tokens."""
    names = ["vanilla"] + (["vanilla_fp32"] if fp32_model is not None else []) + list(variants)
    order = names[rotation % len(names):] + names[:rotation % len(names)]
    results = {}
    for name in order:
        if name == "vanilla":
            results[name] = vanilla_generate(target.model, prompt, max_new_tokens, eos_token_ids=eos)
        elif name == "vanilla_fp32":
            results[name] = vanilla_generate(fp32_model, prompt, max_new_tokens, eos_token_ids=eos)
        else:
            drafter, t = variants[name]
            results[name] = generate(target.model, drafter, prompt, max_new_tokens,
                                     tree=TreeSpec(t["top_k"], t["depth"], t["total_tokens"]), eos_token_ids=eos)
    base = results["vanilla"].tokens
    out = {name: {"tokens": len(res.tokens), "wall_s": res.wall_time, "forwards": res.n_target_forwards,
                  "accept_lengths": list(res.accept_lengths), "draft_s": res.draft_time,
                  "identical": res.tokens == base}
           for name, res in ((n, results[n]) for n in names)}
    for name in variants:  # where a drafter's answer parts from vanilla's: the target's margin there, held to a tie
        tokens = results[name].tokens
        step = next((j for j, (x, y) in enumerate(zip(tokens, base)) if x != y), None)
        if step is not None:
            _, partings = follow_greedy(target.model, prompt, tokens[:step + 1])
            parting = next((p for p in partings if p.step == step), None)
            if parting is None or len(partings) > 1:  # vanilla's own forwards disagree with themselves
                raise RuntimeError(f"{name}: its answer parts from vanilla decoding's at step {step}, but the target's "
                                   f"one-token forwards part at {[p.step for p in partings]}: a nondeterministic "
                                   f"target (set torch.use_deterministic_algorithms)")
            parting.verify_gap = results[name].gaps[step] if step < len(results[name].gaps) else None
            out[name]["parting"] = parting.as_dict()
    return out, base


def fp32_vanilla_pays(turns: list[dict], probe: int = 3) -> bool:
    """Keep timing vanilla decoding with the fp32 copy only while it may be the faster vanilla: over the first
    `probe` turns it runs; after them, only if it was faster there (bf16 one-token decoding beats fp32 on some
    CPUs and loses on others)."""
    both = [t for t in turns if "vanilla_fp32" in t]
    if len(both) < probe:
        return True
    rate = {v: sum(t[v]["tokens"] for t in both) / sum(t[v]["wall_s"] for t in both)
            for v in ("vanilla", "vanilla_fp32")}
    return rate["vanilla_fp32"] >= rate["vanilla"]


def aggregate(turns: list[dict], methods: list[str], trees: dict) -> dict:
    """Per method over every journal turn: tau, alpha_1..3, tokens/s, speedup over the fastest vanilla."""
    if not turns:
        return {}

    def rate(name):
        had = [t for t in turns if name in t]
        return sum(t[name]["tokens"] for t in had) / sum(t[name]["wall_s"] for t in had)

    # fp32 vanilla may have run on the first turns only (fp32_vanilla_pays): then it was the slower one there.
    vanillas = {v: rate(v) for v in ("vanilla", "vanilla_fp32") if v in turns[0]}
    fastest = max(vanillas, key=vanillas.get)
    rows = {"vanilla": {"tau": 1.0, "tokens_per_s": vanillas[fastest], "speedup": 1.0, "precision_of_fastest":
                        "float32" if fastest == "vanilla_fp32" else "target", "tokens_per_s_by_variant": vanillas}}
    for name in methods:
        acc = [a for t in turns for a in t[name]["accept_lengths"]]
        forwards = sum(t[name]["forwards"] for t in turns)
        wall = sum(t[name]["wall_s"] for t in turns)
        # alpha_d past the tree's deepest path (depth + 1 drafts) is undefined, not 0: None.
        reach = trees[name]["depth"] + 1
        alpha = [x if d < reach else None for d, x in enumerate(acceptance_rates(acc, 3))]
        rows[name] = {"tau": sum(a + 1 for a in acc) / forwards, "alpha": alpha,
                      "tokens_per_s": rate(name), "speedup": rate(name) / vanillas[fastest],
                      "draft_share": sum(t[name]["draft_s"] for t in turns) / wall,
                      "identical_to_vanilla": f"{sum(t[name]['identical'] for t in turns)}/{len(turns)}",
                      "tree": {k: trees[name][k] for k in ("depth", "top_k", "total_tokens")}}
    return rows


def markdown(rows: dict) -> str:
    if not rows:
        return "(no turn decoded yet)"
    lines = ["| method | tau | alpha_1 | alpha_2 | alpha_3 | tokens/s | speedup | = vanilla "
             "| tree (depth, top_k, tokens) |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| vanilla | 1 | - | - | - | {rows['vanilla']['tokens_per_s']:.1f} | 1.00x | - | - |"]
    for name, r in rows.items():
        if name == "vanilla":
            continue
        a = " | ".join("-" if x is None else f"{x:.2f}" for x in r["alpha"])
        t = r["tree"]
        lines.append(f"| {name} | **{r['tau']:.2f}** | {a} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['identical_to_vanilla']} | {t['depth']}, {t['top_k']}, {t['total_tokens']} |")
    return "\n".join(lines)
