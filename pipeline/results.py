"""`python -m pipeline.results save|has|card`: the command line of a results store (pipeline/eval/results_store.py),
which keeps a campaign's complete eval and train runs where `outputs/` does not last. `has` composes the eval's
config as pipeline.run does, so it asks for exactly the run that `stage=eval` with the same overrides writes (kept in
this machine's compute precision or, measured on another machine, in its: results_store.kept_as).
`card` writes the model card (README.md) of a committed head: a copy of an export (its files and manifest) and
what the store holds about the head (its train run and every eval of it):

    python -m pipeline.results save outputs/smollm2_quality_v2 results/smollm2_quality_v2
    python -m pipeline.results has results/smollm2_quality_v2 head=eagle3 eval.limit=40 experiment=smollm2_quality_v2
    python -m pipeline.results card heads/smollm2-135m-instruct-eagle3 results/smollm2_quality_v2
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from pipeline.answers import compose
from pipeline.eval import results_store
from pipeline.eval.table import HEADER, eval_summaries, row
from pipeline.files import folder_name, sha256_file
from pipeline.manifest import MANIFEST, check_files, rebuilt_from

CARD = "README.md"
KIND_NAMES = {"eagle3": "EAGLE-3", "eagle1": "EAGLE-1", "medusa": "Medusa"}


def trained_on(train: dict, train_path: Path | None = None) -> str:
    """The card's "trained on" line: the machine the steps ran on. A run whose head a fresh machine rebuilt from
    the complete run's carry (pipeline/train/carry.py: no step trained there) names the carried run's machine,
    as its carry recorded it, else (carries older than that record) the machine of the carried run's manifest
    where git's history of `train_path` keeps it (manifest_machine), else that manifest; and the machine it was
    rebuilt on."""
    machine = train.get("machine") or "an unrecorded machine"
    last = rebuilt_from(train)
    if last is None:
        return f"trained on {machine}"
    sha = last["train_manifest_sha256"]
    origin = (last.get("machine") or (train_path and manifest_machine(train_path, sha))
              or f"the machine its train manifest {sha[:12]} names")
    return f"trained on {origin}; rebuilt on {machine} from its complete carry (no step trained there)"


def manifest_machine(path: Path, sha256: str) -> str | None:
    """The machine named by the version of the manifest at `path` whose sha256 is `sha256`, where git's history
    of that path keeps it (a head rebuilt from its run's carry replaced the run's own train manifest in the
    store); None outside a git checkout or where no version matches."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(path.parent), *args], capture_output=True, check=False)

    log = git("log", "--format=%H", "--", path.name)
    for rev in log.stdout.decode().split() if log.returncode == 0 else []:
        blob = git("show", f"{rev}:./{path.name}").stdout
        if hashlib.sha256(blob).hexdigest() == sha256:
            return json.loads(blob).get("machine")
    return None


def shipped_first(head_dir: Path, evals: list) -> list:
    """The evals of the folder as shipped (eval.head_dir) first, then those of its train run."""
    return sorted(evals, key=lambda e: (e[0] != folder_name(head_dir), e[0], e[1]))


def lossless_claim(head_dir: Path, store: Path) -> str:
    """What the card says of the target's output, from what the store's evals of the shipped folder checked: the
    turns proved to be the target's greedy output (eval's greedy check, exact in fp32), or that none were."""
    shipped = sha256_file(head_dir / MANIFEST)
    checked = [s["greedy_check"] for h, _, s in eval_summaries(store)
               if h == folder_name(head_dir) and s.get("head_manifest_sha256") == shipped and s.get("greedy_check")]
    if not checked:
        return ("Speculative decoding verifies every drafted token with the target, so it sets only how many tokens "
                "each target forward emits (tau, below); no eval of this folder has checked its outputs yet.")
    exact = [g for g in checked if g["precision"] == "float32"]
    on, turns = sum(g["on_greedy_path"] for g in exact), sum(g["turns"] for g in exact)
    ties = sum(g["ties"] for g in checked if g["precision"] != "float32")
    line = (f"Speculative decoding with it sets only how many tokens each target forward emits (tau, below): eaglet's "
            f"eval followed every checked answer with the target's own one-token forwards, and in fp32 {on} of "
            f"{turns} turns were the target's greedy output token for token")
    if on < turns:
        line += " (the others failed the check: see the greedy path column)"
    if ties:
        line += f"; in bf16 {ties} steps parted from it at numerical ties of the precision"
    return line + "."


def model_card(head_dir: Path, store: Path) -> str:
    """The model card of `head_dir` (an export's files with its manifest.json beside them, checked against it):
    what the head is, how it was trained (the store's train manifest of the head), every eval of it the store
    holds, and the commands that serve it from this folder."""
    from pipeline.export.run import SERVE_PATH  # (torch and the export code: only for a card)

    export = json.loads((head_dir / MANIFEST).read_text())
    check_files(head_dir, export["files"], "the head", "copy the export's files and its manifest.json again")
    hc, target, head = export["head_config"], export["target"], export["config"]["head"]
    kind = KIND_NAMES.get(hc["kind"], hc["kind"])
    base = target.get("hub_id") or target.get("name")
    # The store's train run and evals of this name count only if they are of the exported run (a head trained
    # again, e.g. on a lent GPU, is another head): the export names its train manifest's sha256.
    exported = (export.get("inputs") or [{}])[0].get("manifest_sha256")
    train_path = store / "train" / head["name"] / MANIFEST
    train = None
    if train_path.is_file():
        if exported and sha256_file(train_path) != exported:
            raise ValueError(f"{train_path} is not the train run {head_dir} was exported from (its manifest's sha256 "
                             f"differs from the export's input): save the store from the exporting machine's outputs")
        train = json.loads(train_path.read_text())
    weights = export["files"].get("model.safetensors", {})
    lines = ["---", f"base_model: {base}", "library_name: eaglet",
             f"tags: [speculative-decoding, {hc['kind']}, draft-model]", "---", "",
             f"# {head_dir.name}", "",
             f"An {kind} draft head for [{base}](https://huggingface.co/{base}), trained with eaglet (experiment "
             f"`{store.name}`, head `{head['name']}`) and exported in its `{export['format']}` format "
             f"({export['config']['export'].get('dtype', '?')}). {lossless_claim(head_dir, store)}", "",
             "## The head", "",
             "| hidden size | draft vocabulary | target layers fused | TTT rounds | lm_head start | parameters | "
             "model.safetensors |", "|---|---|---|---|---|---|---|",
             f"| {hc['hidden_size']} | {hc.get('draft_vocab_size') or hc.get('vocab_size')} | "
             f"{', '.join(map(str, hc.get('aux_layer_ids') or [])) or 'last'} | {head.get('ttt_steps', '-')} | "
             f"{head.get('lm_head_init', '-')} | {export['counts'].get('parameters', 0):,} | "
             f"{weights.get('bytes', 0):,} B, sha256 `{weights.get('sha256', '?')[:16]}` |", ""]
    lines += ["## Training", ""]
    if train is None:
        lines += [f"The store has no train run of `{head['name']}` ({train_path}).", ""]
    else:
        t, c = train["config"]["train"], train["counts"]
        answers = "the data sets' own answers" if train["config"].get("dump", {}).get("input") == "data" else \
            "the target's own answers (regenerated by eaglet's regen stage)"
        selected = train.get("selected")
        chosen = (f"step {selected['step']} of {selected['last_step']}, the best decoded tau ({selected['tau']:.2f}) "
                  f"of the probes on {t.get('tau_prompts')} validation prompts" if selected else "the last step")
        schedule = t["schedule"] + (f" to {t['min_lr_ratio']:g} of the peak" if t.get("min_lr_ratio") else "")
        coverage = f" ({100 * c['coverage']:.2f}% of the predicted tokens)" if "coverage" in c else ""
        lines += [f"- data: {c['train_rows']:,} conversations, {c.get('train_tokens', 0):,} tokens per epoch, "
                  f"{answers}; {c.get('val_rows', 0)} held out",
                  f"- {t['epochs']} epochs, {c['steps']:,} steps of {t['micro_batch_tokens']:,}-token micro-batches "
                  f"x {t['grad_accum']} x {c.get('world_size', 1)} processes; lr {t['lr']:g}, {schedule}, "
                  f"{t['warmup_steps']} warmup steps; training source: {t['source']}",
                  f"- draft vocabulary: the {c.get('draft_vocab_size', '-')} most frequent predicted tokens"
                  f"{coverage}",
                  f"- final weights: {chosen}",
                  f"- {trained_on(train, train_path)} in {train.get('precision', '?')}", ""]
    # A head rebuilt on a fresh machine from its complete run's carry (pipeline/train/carry.py) is that head: the
    # evals of the run it was carried from count too.
    same = {exported} | {c.get("train_manifest_sha256") for c in (train or {}).get("carries", []) if c.get("complete")}
    # ... and the evals of this folder as shipped (eval.head_dir: under its folder's name, naming its manifest).
    shipped = sha256_file(head_dir / MANIFEST)
    evals = shipped_first(head_dir, [(h, r, s) for h, r, s in eval_summaries(store) if (h == head["name"] and (
        not exported or s.get("head_manifest_sha256", exported) in same)) or (
        h == folder_name(head_dir) and s.get("head_manifest_sha256") == shipped)])
    lines += ["## Quality", ""]
    if evals:
        lines += ["eaglet's tree speculative decoder on the target (`stage=eval`); tau is the mean tokens emitted per "
                  "target forward, the speedup is against plain decoding on the same machine:", "", HEADER,
                  *(row(*e) for e in evals), "",
                  *sorted({f"- `{r}`: {s['machine']}" for _, r, s in evals if s.get("machine")}),
                  *(f"- `{r}`: {s['looping']['turns']} of {s['turns']} answers loop (over "
                    f"{s['looping']['threshold']:g} of their token 4-grams repeat one seen earlier); tau without them "
                    f"{s['looping']['tau_without']:.2f}" for _, r, s in evals
                    if s.get("looping", {}).get("turns") and s["looping"].get("tau_without") is not None), ""]
    else:
        lines += ["No eval of this head in the store yet.", ""]
    serve = []
    for line in export.get("serve_commands", []):  # "serve with SGLang: python -m ..." -> a comment, the command
        what, _, command = line.partition(": ")
        command = command.strip().replace(SERVE_PATH, str(head_dir))
        runnable = command.startswith(("python", "vllm"))  # (llama.cpp's names this machine's GGUF)
        serve += [f"# {what.removeprefix('serve with ')}", command] if runnable else [f"# {what}: {command}"]
    lines += ["## Serving", "", "From the repository root:", "", "```bash", *serve, "```", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", required=True)
    s = sub.add_parser("save", help="copy an experiment folder's complete eval and train runs into the store")
    s.add_argument("experiment_dir", type=Path)
    s.add_argument("store", type=Path)
    h = sub.add_parser("has", help="exit 0 if the store holds the complete eval run these overrides name (in this "
                                   "machine's precision or another's), else 1")
    h.add_argument("store", type=Path)
    h.add_argument("overrides", nargs="*", help="Hydra overrides, as for pipeline.run stage=eval")
    c = sub.add_parser("card", help="write HEAD_DIR/README.md, the model card of a committed export")
    c.add_argument("head_dir", type=Path)
    c.add_argument("store", type=Path)
    args = ap.parse_args(argv)
    if args.action == "save":
        print(json.dumps(results_store.save(args.experiment_dir, args.store)))
        return
    if args.action == "card":
        (args.head_dir / CARD).write_text(model_card(args.head_dir, args.store))
        print(f"{args.head_dir / CARD}")
        return
    cfg = compose([o for o in args.overrides if not o.startswith("stage=")])
    head, run = cfg.eval_subject, cfg.eval_run_name
    kept = results_store.kept_as(args.store, head, run)
    said = "not kept" if kept is None else "kept" if kept == run else f"kept as {kept} (another machine's precision)"
    print(f"{args.store}: eval/{head}/{run} {said}")
    sys.exit(1 if kept is None else 0)


if __name__ == "__main__":
    main()
