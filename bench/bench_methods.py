"""The method bench: vanilla decoding, prompt lookup, Medusa-1, EAGLE-1, EAGLE-3 and EAGLE-3 with the 3.1
options on one decoder harness, the same prompts and the same run (docs/results.md, "Methods compared").

Every method decodes every turn of the same MT-bench questions (T=0), one turn at a time in a rotating order,
so a slow spell of the machine hits all of them alike. Each method's tree is the one eval chooses for this
device with `tree.depth=-1 tree.total_tokens=-1` (autotree.py: the verification cost by tree size measured on
this target and precision, the method's own acceptance from calibration decodes of the first questions' first
turns, exactly as `stage=eval` does). A later turn's history is the vanilla answer, so every method sees the
same prompts even where bf16 numerical ties make a method's answer part from vanilla's.

Per method: tau, alpha_1..3 (n-alpha: P(draft d accepted | drafts before it accepted)), tokens/s, speedup over
the fastest vanilla decoding of the same turns (on a CPU with a bf16 target also an fp32 copy, as eval does),
and how many turns equal vanilla decoding at the methods' precision token for token.

The trained heads come from one experiment (default `outputs/smollm2_methods`, jobs/methods.sh trains them on
one dump with one budget). Each finished turn goes to a journal; a rerun continues after the last one.

    python -m bench.bench_methods                       # ~70 minutes on 2 CPU cores
    python -m bench.bench_methods --limit 2             # a smoke run
Writes bench/results/methods.json (or --out) and prints the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

import torch

from pipeline.data.bad_records import BadRecordReport
from pipeline.data.chat import render_prompt, stop_token_ids
from pipeline.decoding.autotree import choose_tree
from pipeline.decoding.decoder import acceptance_rates, generate, vanilla_generate
from pipeline.decoding.drafter import make_drafter
from pipeline.decoding.lookup import PromptLookupDrafter
from pipeline.eval.config import TreeConfig
from pipeline.eval.evaluate import system_messages
from pipeline.eval.questions import load_questions
from pipeline.heads.io import load_head
from pipeline.manifest import load_manifest
from pipeline.target import TargetConfig, load_target

REPO = Path(__file__).resolve().parents[1]

MT_BENCH = REPO.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
# Table rows: method name -> the head folder under <experiment>/train (None: training-free).
METHODS = {"prompt_lookup": None, "medusa": "medusa", "eagle1": "eagle1", "eagle3": "eagle3",
           "eagle3.1": "eagle3-31"}


def load_drafters(target, train_root: Path, methods: dict) -> tuple[dict, dict]:
    """name -> drafter, and name -> what it is (head config, the training budget from its manifest)."""
    drafters, info = {}, {}
    for name, head_dir in methods.items():
        if head_dir is None:
            drafters[name], info[name] = PromptLookupDrafter(), {"kind": "prompt_lookup", "ngram": [1, 3]}
            continue
        train_dir = train_root / head_dir
        manifest = load_manifest(train_dir, expect_stage="train")
        head = load_head(train_dir, target)
        drafters[name] = make_drafter(head)
        info[name] = {"kind": head.config.kind, "train_dir": str(train_dir), "config": head.config.to_dict(),
                      "steps": manifest.get("counts", {}).get("steps"),
                      "train_s": manifest.get("timings", {}).get("total_s"),
                      "train": {k: manifest["config"]["train"].get(k) for k in
                                ("epochs", "lr", "schedule", "micro_batch_tokens", "warmup_steps", "seed")},
                      "val": manifest.get("final_metrics") or manifest.get("metrics")}
    return drafters, info


def choose_trees(target, drafters: dict, questions, tree: TreeConfig, eos, path: Path) -> dict:
    """Each method's tree for this device (kept in `path`, so a resumed bench decodes with the same trees)."""
    chosen = json.loads(path.read_text()) if path.is_file() else {}
    first_turns = [system_messages(q) + [{"role": "user", "content": q.turns[0]}]
                   for q in questions[:tree.auto_prompts]]
    prompts = [torch.tensor(render_prompt(target.tokenizer, m)) for m in first_turns]
    for name, drafter in drafters.items():
        if name in chosen:
            continue
        choice = choose_tree(target.model, drafter, prompts, tree.top_k, -1, -1, tree.max_depth,
                             tree.max_total_tokens, tree.auto_max_new_tokens, eos)
        chosen[name] = choice.as_dict()
        print(f"{name}: tree depth {choice.depth} top_k {choice.top_k} total_tokens {choice.total_tokens}", flush=True)
        path.write_text(json.dumps(chosen, indent=1) + "\n")
    return chosen


def decode_turn(target, fp32_model, variants: dict, prompt: torch.Tensor, max_new_tokens: int, eos,
                rotation: int) -> tuple[dict, list[int]]:
    """Vanilla decoding (and its fp32 copy's) and every variant (name -> (drafter, tree dict)) on one prompt, in
    an order rotated by `rotation` -> per-variant record, vanilla's tokens."""
    names = ["vanilla"] + (["vanilla_fp32"] if fp32_model is not None else []) + list(variants)
    order = names[rotation % len(names):] + names[:rotation % len(names)]
    out, results = {}, {}
    for name in order:
        if name == "vanilla":
            results[name] = vanilla_generate(target.model, prompt, max_new_tokens, eos_token_ids=eos)
        elif name == "vanilla_fp32":
            results[name] = vanilla_generate(fp32_model, prompt, max_new_tokens, eos_token_ids=eos)
        else:
            drafter, t = variants[name]
            results[name] = generate(target.model, drafter, prompt, max_new_tokens, top_k=t["top_k"],
                                     depth=t["depth"], total_tokens=t["total_tokens"], eos_token_ids=eos)
    base = results["vanilla"].tokens
    for name in names:
        res = results[name]
        out[name] = {"tokens": len(res.tokens), "wall_s": res.wall_time, "forwards": res.n_target_forwards,
                     "accept_lengths": list(res.accept_lengths), "draft_s": res.draft_time,
                     "identical": res.tokens == base}
    return out, base


def fp32_vanilla_pays(turns: list[dict], probe: int = 3) -> bool:
    """Keep timing vanilla decoding with the fp32 copy only while it may be the faster vanilla: over the first
    `probe` turns it runs; after them, only if it was faster there (bf16 one-token decoding beats fp32 on some
    CPUs and loses on others, docs/results.md)."""
    both = [t for t in turns if "vanilla_fp32" in t]
    if len(both) < probe:
        return True
    rate = {v: sum(t[v]["tokens"] for t in both) / sum(t[v]["wall_s"] for t in both)
            for v in ("vanilla", "vanilla_fp32")}
    return rate["vanilla_fp32"] >= rate["vanilla"]


def aggregate(turns: list[dict], methods: list[str], trees: dict) -> dict:
    """Per method over every journal turn: tau, alpha_1..3, tokens/s, speedup over the fastest vanilla."""
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


def choice_if_verification_were_flat(choice: dict) -> dict:
    """The tree `choice`'s table would give if a verification forward cost the same for every size, as on a
    GPU far from its compute bound (a 135M target on an H200), drafting keeping its measured share: every
    (depth, N) re-timed with verify(N) = verify(smallest N)."""
    verify = {int(n): ms for n, ms in choice["verify_ms"].items()}
    flat, draft = min(verify.values()), choice["draft_ms_per_round"]
    best = max(choice["table"], key=lambda r: r["tokens_per_step"] / (draft * (r["depth"] + 2) + flat))
    return {"depth": best["depth"], "total_tokens": best["total_tokens"], "tokens_per_step": best["tokens_per_step"]}


def markdown(rows: dict, info: dict) -> str:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment-dir", default=str(REPO / "outputs" / "smollm2_methods"))
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
    exp = Path(args.experiment_dir)
    run = f"{Path(args.questions).parent.name}-n{args.limit}-m{args.max_new_tokens}-{args.dtype}"
    work = exp / "bench_methods" / run
    work.mkdir(parents=True, exist_ok=True)
    journal = work / "turns.jsonl"

    target = load_target(TargetConfig(dtype=args.dtype))
    fp32_model = None
    if target.device.type == "cpu" and target.precision != "float32":  # eval's rule: the fastest vanilla
        fp32_model = load_target(dataclasses.replace(TargetConfig(), dtype="float32")).model
    methods = {m: METHODS[m] for m in args.methods.split(",")}
    drafters, info = load_drafters(target, exp / "train", methods)
    questions = load_questions(args.questions, args.limit, BadRecordReport())
    eos = set(stop_token_ids(target.tokenizer, target.model))
    t0 = time.perf_counter()
    trees = choose_trees(target, drafters, questions, TreeConfig(), eos, work / "trees.json")
    choice_s = time.perf_counter() - t0

    done = [json.loads(line) for line in journal.read_text().splitlines()] if journal.is_file() else []
    answers = {(t["question_id"], t["turn"]): t["vanilla_answer"] for t in done}
    variants = {m: (drafters[m], trees[m]) for m in drafters}
    # Turn-major: every question's first turn, then every second turn (its history: the vanilla first answer),
    # so a bench stopped early has covered whole turns of every question.
    for ti in range(0 if args.report_only else max(len(q.turns) for q in questions)):
        for q in (q for q in questions if ti < len(q.turns) and (q.id, ti) not in answers):
            messages = system_messages(q)
            for tj in range(ti):
                messages += [{"role": "user", "content": q.turns[tj]},
                             {"role": "assistant", "content": answers[(q.id, tj)]}]
            messages.append({"role": "user", "content": q.turns[ti]})
            prompt = torch.tensor(render_prompt(target.tokenizer, messages))
            fp32 = fp32_model if fp32_vanilla_pays(done) else None
            record, base = decode_turn(target, fp32, variants, prompt, args.max_new_tokens, eos, len(done))
            answers[(q.id, ti)] = target.tokenizer.decode(base, skip_special_tokens=True).strip()
            entry = {"question_id": q.id, "turn": ti, "category": q.category, "prompt_tokens": len(prompt),
                     "vanilla_answer": answers[(q.id, ti)], **record}
            with journal.open("a") as f:
                f.write(json.dumps(entry) + "\n")
            done.append(entry)
            print(f"[{len(done)}] q{q.id} turn {ti + 1}: " + "  ".join(
                f"{name} {r['tokens'] / r['wall_s']:.1f}" for name, r in record.items()), flush=True)

    rows = aggregate(done, list(drafters), trees)
    table = markdown(rows, info)
    print(table)
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                          "torch": torch.__version__},
              "questions": args.questions, "limit": args.limit, "turns": len(done),
              "turns_by_index": {str(i + 1): sum(t["turn"] == i for t in done) for i in range(2)},
              "max_new_tokens": args.max_new_tokens, "temperature": 0, "precision": target.precision,
              "tree_choice_s": choice_s, "rows": rows, "methods": info, "tree_choices": trees, "table": table,
              "tree_if_verification_were_flat": {m: choice_if_verification_were_flat(c) for m, c in trees.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
