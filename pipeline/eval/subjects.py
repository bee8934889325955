"""What an eval run decodes with: the drafters (a trained head or a training-free one), the tree chosen for this
device, and the fp32 copy of the target its vanilla baseline is also timed with. Shared by a single-drafter eval
(run.py) and a comparison of several (compare.py)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Optional

import torch

from pipeline.data.chat import check_thinking, render_prompt, stop_token_ids
from pipeline.decoding.autotree import choose_tree
from pipeline.decoding.drafter import make_drafter
from pipeline.decoding.lookup import PromptLookupDrafter
from pipeline.dist import TargetLayout
from pipeline.eval.evaluate import system_messages
from pipeline.files import atomic_write_text
from pipeline.heads.io import load_head
from pipeline.manifest import MANIFEST, TrainManifest
from pipeline.target import head_target, load_target

TREE_CHOICE = "tree_choice.json"

# eval.head_dir: how an export folder becomes a head, the export stage's own reader (load_shipped_head). Stages never
# import each other; the entry point gives it here (pipeline/run.py, `wire_stages`).
_shipped_head_loader: Optional[Callable] = None


def use_shipped_head_loader(loader: Callable) -> None:
    """`loader(export_dir, target, allow_template_mismatch) -> (head, export manifest)`."""
    global _shipped_head_loader
    _shipped_head_loader = loader


def fp32_baseline_model(cfg, target):
    """On CPU, vanilla decoding of a reduced-precision target is timed in fp32 too: one-token forwards
    can be slower in bf16 there (measured: 18.0 against 26.5 tokens/s), and speedup must be measured
    against the fastest vanilla decoding. GPUs decode fastest in bf16: no copy."""
    if not cfg.eval.baseline or target.device.type != "cpu" or target.precision == "float32":
        return None
    return load_target(dataclasses.replace(cfg.target, dtype="float32")).model


def build_drafter(cfg, target, subject: Optional[str] = None):
    """The drafter of `subject` (`prompt_lookup`, or a head's name under this experiment's train/; None: this
    run's `cfg.eval_subject`), what the summary says of it, and the stage dirs it read (their manifests go into
    the eval's identity and its manifest's inputs)."""
    subject = subject or cfg.eval_subject
    if subject == "prompt_lookup":
        lk = cfg.eval.lookup
        info = {"name": "prompt_lookup", "kind": "prompt_lookup", "max_ngram": lk.max_ngram, "min_ngram": lk.min_ngram}
        return PromptLookupDrafter(lk.max_ngram, lk.min_ngram), info, []
    if cfg.eval.head_dir and subject == cfg.eval_subject:  # an exported head, as shipped
        if _shipped_head_loader is None:
            raise RuntimeError("eval.head_dir reads an export folder with the export stage's reader, which "
                               "pipeline.run gives eval: run the stage through pipeline.run (run_stages)")
        head_dir = Path(cfg.eval.head_dir)
        head, manifest = _shipped_head_loader(head_dir, head_target(target, cfg.target),
                                              allow_template_mismatch=cfg.eval.allow_template_mismatch)
        head = head.to(device=target.device, dtype=target.dtype)
        trained = (manifest.inputs or [{}])[0].get("manifest_sha256")
        info = {"name": subject, "kind": head.config.kind, "export": str(head_dir), "export_format": manifest.format,
                "export_code_version": manifest.code_version, "train_manifest_sha256": trained,
                "config": head.config.to_dict()}
        return make_drafter(head), info, [head_dir]
    train_dir = cfg.experiment_dir / "train" / subject
    train_manifest = TrainManifest.load(train_dir)
    # Refuses a head trained on another target (or chat template, unless allowed on purpose).
    head = load_head(train_dir, head_target(target, cfg.target),
                     allow_template_mismatch=cfg.eval.allow_template_mismatch)
    # The prompts are rendered with regen.thinking: it must be the mode the head's rows were rendered in.
    check_thinking(cfg.regen.thinking, train_manifest, train_dir / MANIFEST, "eval.allow_thinking_mismatch",
                   cfg.eval.allow_thinking_mismatch)
    info = {"name": subject, "kind": head.config.kind,
            "train_manifest_code_version": train_manifest.code_version, "config": head.config.to_dict()}
    return make_drafter(head), info, [train_dir]


def tree_choice(cfg, target, drafter, questions, out_dir: Path, resumed: bool, layout: TargetLayout = None,
                name: str = TREE_CHOICE) -> dict:
    """The tree of tree.depth/total_tokens=-1 (autotree.py), measured once per run: kept beside the partial
    answers (as `name`), so a resumed eval answers its remaining questions with the tree its first ones had. A
    tensor-parallel target's ranks all measure (their forwards are collective) and take the first rank's choice."""
    path = out_dir / name
    layout = layout or TargetLayout(0, 1, 0)
    kept = layout.agree(json.loads(path.read_text()) if layout.is_writer and resumed and path.is_file() else None)
    if kept is not None:
        return kept
    t = cfg.tree
    first_turns = [system_messages(q) + [{"role": "user", "content": q.turns[0]}] for q in questions[:t.auto_prompts]]
    prompts = [torch.tensor(render_prompt(target.tokenizer, m, system_prompt=cfg.data.system_prompt,
                                          thinking=cfg.regen.thinking)) for m in first_turns]
    choice = choose_tree(target.model, drafter, prompts, t.top_k, t.depth, t.total_tokens, t.max_depth,
                         t.max_total_tokens, t.auto_max_new_tokens,
                         set(stop_token_ids(target.tokenizer, target.model))).as_dict()
    choice = layout.agree(choice)
    if layout.is_writer:
        atomic_write_text(path, json.dumps(choice, indent=1) + "\n")
    return choice
