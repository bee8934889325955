"""The method's classic analyses, reproducible (docs/results/analyses.md), on the method bench's
EAGLE-3 head (`outputs/smollm2_methods/train/eagle3`, jobs/methods.sh):

1. `draft`: tau, acceptance by depth, tokens/s and speedup against the draft length K of a chain (K = 1..8:
   top_k 1, K drafts a step) and against the size of the EAGLE-2 tree (total_tokens 5, 10, 15, 30, 60 at
   top_k 10, depth 6), measured by decoding held-out MT-bench questions (41 on: the method table uses 1-40)
   with every variant prompt by prompt, in a rotating order, next to vanilla decoding. Beside the chain's
   measured tau: the closed form (1 - alpha^(K+1)) / (1 - alpha) with alpha = the K = 1 chain's acceptance,
   and the product form 1 + sum_k prod_{d<=k} alpha_d with the measured acceptance by depth.
2. `template`: the chat-template experiment. `stage=eval` twice on the same head and questions: with the
   target's own template, and with a plain Vicuna-style one (`target.chat_template=vicuna`, allowed on
   purpose with `eval.allow_template_mismatch=true`); tau and what the answers look like, side by side.
3. `tree`: a picture of one drafted tree at one decoding step (node = draft token and its cumulative draft
   log-probability; the accepted path highlighted).

    python -m bench.analyses                  # all three, ~25 minutes on 2 CPU cores
    python -m bench.analyses --only tree      # one of them
Writes bench/results/analyses.json and the pictures under docs/results/.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import torch

from bench.bench_methods import MT_BENCH
from pipeline.data.bad_records import BadRecordReport
from pipeline.data.chat import render_prompt, stop_token_ids
from pipeline.decoding.autotree import RecordingDrafter, accepted_paths
from pipeline.decoding.decoder import acceptance_rates, generate
from pipeline.decoding.drafter import make_drafter
from pipeline.decoding.tree import TreeSpec
from pipeline.eval.compare import aggregate, decode_turn, fp32_vanilla_pays
from pipeline.eval.questions import load_questions
from pipeline.heads.io import load_head
from pipeline.target import TargetConfig, load_target

REPO = Path(__file__).resolve().parents[1]

FIGURES = REPO / "docs" / "results"
CHAINS = range(1, 9)
TREE_SIZES = (5, 10, 15, 30, 60)


def held_out(n: int) -> list:
    """MT-bench questions 41.. (the method table decodes 1-40 and calibrates its trees on 1-3)."""
    return load_questions(str(MT_BENCH), 40 + n, BadRecordReport())[40:]


# ---------------------------------------------------------------------------------------------
# 1. draft length and tree size


def draft_sweep(target, fp32_model, head, prompts: int, max_new_tokens: int, work: Path) -> dict:
    drafter = make_drafter(head)
    trees = {f"chain{k}": {"top_k": 1, "depth": k - 1, "total_tokens": k + 1} for k in CHAINS}
    trees.update({f"tree{n}": {"top_k": 10, "depth": 6, "total_tokens": n} for n in TREE_SIZES})
    variants = {name: (drafter, t) for name, t in trees.items()}
    eos = set(stop_token_ids(target.tokenizer, target.model))
    journal = work / "draft_sweep.jsonl"
    done = [json.loads(line) for line in journal.read_text().splitlines()] if journal.is_file() else []
    for i, q in enumerate(held_out(prompts)):
        if i < len(done):
            continue
        prompt = torch.tensor(render_prompt(target.tokenizer, [{"role": "user", "content": q.turns[0]}]))
        fp32 = fp32_model if fp32_vanilla_pays(done) else None
        record, _ = decode_turn(target, fp32, variants, prompt, max_new_tokens, eos, i)
        with journal.open("a") as f:
            f.write(json.dumps({"question_id": q.id, **record}) + "\n")
        done.append(record)
        print(f"[draft sweep] {i + 1}/{prompts}: " + "  ".join(f"{n} {r['tokens'] / r['wall_s']:.1f}"
                                                               for n, r in record.items()), flush=True)
    rows = aggregate(done, list(trees), trees)
    deepest = [a for t in done for a in t["chain8"]["accept_lengths"]]
    alpha_by_depth = acceptance_rates(deepest, 8)
    alpha = rows["chain1"]["tau"] - 1  # the K = 1 chain: P(one draft accepted)
    for k in CHAINS:
        r = rows[f"chain{k}"]
        r["alpha_by_depth"] = acceptance_rates([a for t in done for a in t[f"chain{k}"]["accept_lengths"]], k)
        r["closed_form"] = (1 - alpha ** (k + 1)) / (1 - alpha)
        prod, tau = 1.0, 1.0
        for a in alpha_by_depth[:k]:
            if prod == 0:  # no step got this deep: alpha_d is undefined (nan), and adds nothing
                break
            prod *= a
            tau += prod
        r["product_form"] = tau
    plot_draft_sweep(rows, alpha, alpha_by_depth, FIGURES / "draft_length.png")
    return {"prompts": len(done), "max_new_tokens": max_new_tokens, "alpha": alpha,
            "alpha_by_depth_chain8": alpha_by_depth, "rows": rows}


def plot_draft_sweep(rows: dict, alpha: float, alpha_by_depth: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = list(CHAINS)
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    ax[0, 0].plot(ks, [rows[f"chain{k}"]["tau"] for k in ks], "o-", label="measured")
    ax[0, 0].plot(ks, [rows[f"chain{k}"]["closed_form"] for k in ks], "s--",
                  label=f"(1 - a^(K+1)) / (1 - a), a = {alpha:.2f}")
    ax[0, 0].plot(ks, [rows[f"chain{k}"]["product_form"] for k in ks], "x:", label="1 + sum prod alpha_d (measured)")
    ax[0, 0].set(xlabel="draft length K (chain)", ylabel="tau", title="Chain: tau against K")
    ax[0, 0].legend(fontsize=8)
    ax[0, 1].bar(range(1, len(alpha_by_depth) + 1), alpha_by_depth)
    ax[0, 1].axhline(alpha, color="k", ls="--", lw=1, label=f"a (K = 1) = {alpha:.2f}")
    ax[0, 1].set(xlabel="draft depth d", ylabel="P(draft d accepted | 1..d-1 accepted)",
                 title="Chain K = 8: acceptance by depth", ylim=(0, 1))
    ax[0, 1].legend(fontsize=8)
    ax[1, 0].plot(ks, [rows[f"chain{k}"]["speedup"] for k in ks], "o-")
    ax[1, 0].axhline(1, color="k", lw=1)
    ax[1, 0].set(xlabel="draft length K (chain)", ylabel="speedup over vanilla", title="Chain: speedup (this CPU)")
    ns = list(TREE_SIZES)
    ax[1, 1].plot(ns, [rows[f"tree{n}"]["tau"] for n in ns], "o-", color="C2", label="tau")
    ax[1, 1].set(xlabel="tree size (total_tokens; top_k 10, depth 6)", ylabel="tau", title="Tree: tau and speedup")
    twin = ax[1, 1].twinx()
    twin.plot(ns, [rows[f"tree{n}"]["speedup"] for n in ns], "s--", color="C3", label="speedup")
    twin.axhline(1, color="C3", lw=0.8, ls=":")
    twin.set_ylabel("speedup over vanilla")
    ax[1, 1].legend(loc="upper left", fontsize=8)
    twin.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# 2. the chat template


def template_experiment(args) -> dict:
    """stage=eval with the target's template and with the plain one, through the real CLI."""
    common = ["experiment=smollm2_methods", "head=eagle3", f"eval.limit={args.template_questions}",
              "eval.baseline=false", f"eval.max_new_tokens={args.max_new_tokens}", "tree.top_k=8", "tree.depth=3",
              "tree.total_tokens=16", "wandb.mode=disabled", f"output_root={args.output_root}"]
    runs = {"own": [], "vicuna": ["target.chat_template=vicuna", "eval.allow_template_mismatch=true"]}
    out = {}
    for name, extra in runs.items():
        cmd = [sys.executable, "-m", "pipeline.run", "stage=eval", *common, *extra]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        run_dir = Path(re.search(r"-> (\S+)", proc.stdout).group(1))
        summary = json.loads((run_dir / "summary.json").read_text())
        answers = [json.loads(line) for line in (run_dir / "answers.jsonl").read_text().splitlines()]
        out[name] = {"command": "python -m pipeline.run stage=eval " + " ".join(common[:-1] + extra),
                     "run_dir": str(run_dir), "tau": summary["tau"],
                     "alpha": summary["acceptance_by_depth"][:3], **answer_quality(answers, args.max_new_tokens),
                     "examples": [{"question_id": a["question_id"], "turn": a["turn"], "answer": a["answer"][:400]}
                                  for a in answers[:4]]}
    plot_template(out, FIGURES / "chat_template.png")
    return out


def plot_template(result: dict, path: Path) -> None:
    """tau and acceptance by depth, and what the answers look like, for each template side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result)
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    left = ["tau - 1", "alpha_1", "alpha_2", "alpha_3"]
    right = ["ended_by_eos", "repeated_4grams", "role_markers"]
    for i, name in enumerate(names):
        r = result[name]
        ax[0].bar([x + 0.4 * i for x in range(4)], [r["tau"] - 1] + r["alpha"], 0.4, label=name)
        ax[1].bar([x + 0.4 * i for x in range(3)], [r[k] for k in right], 0.4, label=name)
    ax[0].set_xticks([x + 0.2 for x in range(4)], left)
    ax[0].set(title="Acceptance: the same head, two chat templates", ylim=(0, 1))
    ax[1].set_xticks([x + 0.2 for x in range(3)], ["answers ended\nby EOS", "repeated\nword 4-grams",
                                                   "answers with\nrole markers"])
    ax[1].set(title="The answers (share of turns / of 4-grams)", ylim=(0, 1))
    for a in ax:
        a.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


ROLE_MARKERS = re.compile(r"USER:|ASSISTANT:|<\|im_start\|>|\buser\n|\bassistant\n", re.I)


def answer_quality(answers: list[dict], max_new_tokens: int) -> dict:
    """What can be told about answers without a judge: length, ending on its own (EOS before the budget),
    repetition (share of repeated word 4-grams), and role markers written into the answer (the model
    continuing the transcript on its own, the classic symptom of a wrong template)."""
    repeated, total = 0, 0
    for a in answers:
        words = a["answer"].split()
        grams = [tuple(words[i:i + 4]) for i in range(len(words) - 3)]
        repeated += len(grams) - len(set(grams))
        total += len(grams)
    return {"turns": len(answers), "mean_new_tokens": sum(a["new_tokens"] for a in answers) / len(answers),
            "ended_by_eos": sum(a["new_tokens"] < max_new_tokens for a in answers) / len(answers),
            "repeated_4grams": repeated / max(total, 1),
            "role_markers": sum(bool(ROLE_MARKERS.search(a["answer"])) for a in answers) / len(answers),
            "empty": sum(not a["answer"].strip() for a in answers) / len(answers)}


# ---------------------------------------------------------------------------------------------
# 3. one drafted tree


def tree_picture(target, head, path: Path) -> dict:
    """Decode one held-out question with the (6, 10, 60) tree and draw the step that accepted the most."""
    drafter = RecordingDrafter(make_drafter(head))
    q = held_out(1)[0]
    prompt = torch.tensor(render_prompt(target.tokenizer, [{"role": "user", "content": q.turns[0]}]))
    res = generate(target.model, drafter, prompt, 96, tree=TreeSpec(10, 6, 60),
                   eos_token_ids=set(stop_token_ids(target.tokenizer, target.model)))
    paths = accepted_paths(drafter.trees, res.tokens, res.accept_lengths)
    step = max(range(len(paths)), key=lambda s: (len(paths[s]), -s))
    tree, accepted = drafter.trees[step], paths[step]
    emitted = 1 + sum(a + 1 for a in res.accept_lengths[:step])
    context = target.tokenizer.decode(res.tokens[:emitted])
    draw_tree(tree, accepted, target.tokenizer, path, f"question {q.id}, step {step + 1}: after ...{context[-60:]!r}")
    return {"question_id": q.id, "step": step + 1, "nodes": len(tree), "accepted": len(accepted) - 1,
            "accepted_text": target.tokenizer.decode([tree.token_list[i] for i in accepted[1:]])}


def draw_tree(tree, accepted: list[int], tokenizer, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    leaves: list[int] = []

    def order(node: int) -> None:  # leaves top to bottom in sibling order (the order verification tries)
        if not tree.children[node]:
            leaves.append(node)
        for c in tree.children[node]:
            order(c)

    order(0)
    y = {leaf: -i for i, leaf in enumerate(leaves)}
    for node in reversed(range(len(tree))):  # children come after their parent: fill parents bottom-up
        if node not in y:
            y[node] = sum(y[c] for c in tree.children[node]) / len(tree.children[node])
    on_path = set(accepted)
    fig, ax = plt.subplots(figsize=(2.3 * (max(tree.depths) + 1), 0.32 * len(leaves) + 1.2))
    for node in range(1, len(tree)):
        p = tree.parents[node]
        hot = node in on_path and p in on_path
        ax.plot([tree.depths[p], tree.depths[node]], [y[p], y[node]], color="C3" if hot else "0.75",
                lw=2.2 if hot else 0.8, zorder=1)
    for node in range(len(tree)):
        text = tokenizer.decode([tree.token_list[node]])
        score = "" if node == 0 else f"  {float(tree.scores[node]):.2f}"
        ax.text(tree.depths[node], y[node], f"{text!r}{score}", fontsize=7.5, ha="center", va="center", zorder=2,
                bbox={"boxstyle": "round,pad=0.2", "fc": "#ffd9d2" if node in on_path else "white",
                      "ec": "C3" if node in on_path else "0.6", "lw": 1.2 if node in on_path else 0.6})
    ax.set_xticks(range(max(tree.depths) + 1))
    ax.set_xticklabels(["root"] + [f"depth {d}" for d in range(1, max(tree.depths) + 1)])
    ax.set_yticks([])
    ax.set_xlim(-0.6, max(tree.depths) + 0.6)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"EAGLE-3 draft tree (top_k 10, depth 6, 60 tokens), {title}\nnode: token and cumulative draft "
                 f"log-prob; red: the path the target accepted", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-root", default=str(REPO / "outputs"))
    ap.add_argument("--head", default="eagle3", help="head folder under <output-root>/smollm2_methods/train")
    ap.add_argument("--only", default="draft,template,tree")
    ap.add_argument("--prompts", type=int, default=8, help="held-out questions of the draft sweep")
    ap.add_argument("--template-questions", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "analyses.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    exp = Path(args.output_root) / "smollm2_methods"
    out_path = Path(args.out)
    result = json.loads(out_path.read_text()) if out_path.is_file() else {}
    only = args.only.split(",")
    if "draft" in only or "tree" in only:
        target = load_target(TargetConfig())
        head = load_head(exp / "train" / args.head, target)
        if "draft" in only:
            fp32_model = None
            if target.device.type == "cpu" and target.precision != "float32":
                fp32_model = load_target(dataclasses.replace(TargetConfig(), dtype="float32")).model
            work = exp / "analyses"
            work.mkdir(parents=True, exist_ok=True)
            result["draft"] = {"precision": target.precision,
                               **draft_sweep(target, fp32_model, head, args.prompts, args.max_new_tokens, work)}
        if "tree" in only:
            result["tree"] = tree_picture(target, head, FIGURES / "draft_tree.png")
    if "template" in only:
        result["template"] = template_experiment(args)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items()}, indent=1)[:4000])
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
