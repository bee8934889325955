"""Tree size on this machine: what a verification forward costs, and which draft tree decodes fastest with a
trained head (the tree is picked by measuring; the quality experiment's tree is depth 6, top_k 10, 60 tokens).

1. Forward cost: median wall time of one tree-verification forward of N tokens (N = 1 is a vanilla decode
   step) on a 400-token KV prefix, SmolLM2-135M, with the decoder's own `target_forward`, as a ratio to
   N = 1. On a GPU this ratio stays near 1 up to ~64 tokens; on a CPU the forward is compute bound, so a
   big tree costs several vanilla steps and must buy that back with tau.
2. Sweep: the same held-out prompts (Alpaca seed tasks, not in the training data) decoded greedily by
   vanilla decoding and by each tree, prompt by prompt in the same process, so drift hits every variant.
   Prints tau, tokens/s and the speedup over vanilla, and checks that every output equals vanilla's.

    flock /tmp/eaglet-cpu.lock python -m bench.bench_tree \
        --train-dir outputs/smollm2_quality/train/eagle3          # ~6 minutes on 2 cores
Writes bench/results/tree.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from pipeline.data.chat import render_prompt, stop_token_ids
from pipeline.decoding.autotree import choose_tree, verify_costs
from pipeline.decoding.decoder import generate, vanilla_generate
from pipeline.decoding.drafter import make_drafter
from pipeline.decoding.tree import TreeSpec
from pipeline.heads.io import load_head
from pipeline.target import TargetConfig, load_target

REPO = Path(__file__).resolve().parents[1]

SEED_TASKS = REPO.parent / "shared" / "data" / "alpaca_seed_tasks" / "seed_tasks.jsonl"
# (depth, top_k, total_tokens): the quality experiment's tree, three smaller trees, and two chains (top_k = 1).
TREES = [(6, 10, 60), (5, 8, 32), (4, 6, 16), (3, 4, 8), (2, 1, 4), (1, 1, 3)]


def held_out_prompts(tokenizer, n: int, skip: int = 0) -> list[list[int]]:
    prompts = []
    for line in SEED_TASKS.read_text().splitlines()[skip:skip + n]:
        task = json.loads(line)
        extra = task["instances"][0]["input"] if task["instances"] else ""
        text = task["instruction"] + (f"\n\n{extra}" if extra else "")
        prompts.append(render_prompt(tokenizer, [{"role": "user", "content": text}]))
    return prompts


def sweep(target, head, prompts, max_new_tokens: int, trees: list[tuple[int, int, int]], repeats: int = 1,
          names: list[str] | None = None) -> dict:
    """Every variant on every prompt, interleaved (prompt by prompt, `repeats` rounds), so drift of the
    machine's speed hits all of them alike."""
    model = target.model
    eos = set(stop_token_ids(target.tokenizer, model))
    drafter = make_drafter(head)
    names = ["vanilla"] + (names or [f"d{d}_k{k}_n{n}" for d, k, n in trees])
    acc = {name: {"wall_s": 0.0, "tokens": 0, "forwards": 0, "accepted": 0, "identical": 0} for name in names}
    for p in [p for _ in range(repeats) for p in prompts]:
        ids = torch.tensor(p)
        base = vanilla_generate(model, ids, max_new_tokens, eos_token_ids=eos)
        acc["vanilla"]["wall_s"] += base.wall_time
        acc["vanilla"]["tokens"] += len(base.tokens)
        for (d, k, n), name in zip(trees, names[1:]):
            res = generate(model, drafter, ids, max_new_tokens, tree=TreeSpec(k, d, n), eos_token_ids=eos)
            a = acc[name]
            a["wall_s"] += res.wall_time
            a["tokens"] += len(res.tokens)
            a["forwards"] += res.n_target_forwards
            a["accepted"] += sum(x + 1 for x in res.accept_lengths)
            a["identical"] += res.tokens == base.tokens
        print(f"prompt {len(p)} tokens done", flush=True)
    van_rate = acc["vanilla"]["tokens"] / acc["vanilla"]["wall_s"]
    rows = {"vanilla": {"tokens_per_s": van_rate}}
    for (d, k, n), name in zip(trees, names[1:]):
        a = acc[name]
        rate = a["tokens"] / a["wall_s"]
        rows[name] = {"depth": d, "top_k": k, "total_tokens": n, "tau": a["accepted"] / a["forwards"],
                      "tokens_per_s": rate, "speedup": rate / van_rate,
                      "identical_to_vanilla": f"{a['identical']}/{len(prompts) * repeats}"}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-dir", default=str(REPO / "outputs" / "smollm2_quality" / "train" / "eagle3"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trees", default=" ".join(",".join(map(str, t)) for t in TREES),
                    help="space-separated depth,top_k,total_tokens triples (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds over the prompts")
    ap.add_argument("--auto", action="store_true",
                    help="add the tree eval picks with tree.depth=-1 tree.total_tokens=-1 (autotree.py), calibrated "
                         "on other seed tasks than the swept prompts")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "tree.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    train_dir = Path(args.train_dir)
    if not (train_dir / "manifest.json").exists():
        sys.exit(f"{train_dir}: no finished train stage (manifest.json); train a SmolLM2 head first "
                 f"(python -m pipeline.run stage=train experiment=smollm2_quality head=eagle3)")
    target = load_target(TargetConfig())
    head = load_head(train_dir, target)

    sizes = [1, 4, 8, 16, 32, 60]
    cost = verify_costs(target.model, sizes, repeats=7, prefix_tokens=400)
    print("verification forward, 400-token prefix:")
    for n in sizes:
        print(f"  {n:3d} tokens  {cost[n] * 1000:6.1f} ms  = {cost[n] / cost[1]:.2f} x the 1-token step")

    trees = [tuple(int(x) for x in t.split(",")) for t in args.trees.split()]
    names = [f"d{d}_k{k}_n{n}" for d, k, n in trees]
    choice = None
    if args.auto:
        calib = [torch.tensor(p) for p in held_out_prompts(target.tokenizer, 3, skip=args.prompts)]
        choice = choose_tree(target.model, make_drafter(head), calib, 10, -1, -1, 8, 128, 64,
                             set(stop_token_ids(target.tokenizer, target.model)))
        trees.append((choice.depth, choice.top_k, choice.total_tokens))
        names.append("auto")
    rows = sweep(target, head, held_out_prompts(target.tokenizer, args.prompts), args.max_new_tokens, trees,
                 args.repeats, names)
    print(f"\n{args.prompts} held-out prompts x {args.max_new_tokens} tokens, greedy, head {train_dir}:")
    print(f"  vanilla                 {rows['vanilla']['tokens_per_s']:5.1f} tok/s")
    for name, r in rows.items():
        if name != "vanilla":
            print(f"  depth {r['depth']} top_k {r['top_k']:2d} n {r['total_tokens']:2d}  tau {r['tau']:.2f}  "
                  f"{r['tokens_per_s']:5.1f} tok/s  speedup {r['speedup']:.2f}x  identical {r['identical_to_vanilla']}")
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                          "torch": torch.__version__},
              "train_dir": str(train_dir), "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
              "forward_ms": {n: cost[n] * 1000 for n in sizes},
              "forward_ratio_to_1": {n: cost[n] / cost[1] for n in sizes}, "sweep": rows,
              "repeats": args.repeats, "auto_choice": choice.as_dict() if choice else None}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
