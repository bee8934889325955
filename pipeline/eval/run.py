"""Stage eval: tau and speedup of a trained head (or a training-free drafter) with the tree speculative decoder;
with `eval.compare`, several drafters side by side (compare.py)."""
from __future__ import annotations

import hashlib
import json
import logging
import time

from pipeline.data.bad_records import BadRecordReport
from pipeline.decoding.drafter import lockstep
from pipeline.dist import rank_info, rank_target_config, target_layout
from pipeline.eval import compare
from pipeline.eval.evaluate import answer_questions, record_dict
from pipeline.eval.progress import EvalProgress
from pipeline.eval.questions import load_questions
from pipeline.eval.report import format_summary, log_wandb, plot_summary, summarize
from pipeline.eval.subjects import build_drafter, fp32_baseline_model, tree_choice
from pipeline.files import atomic_write_text, sha256_file
from pipeline.manifest import MANIFEST, to_plain, write_manifest
from pipeline.precision import machine_description
from pipeline.target import load_target

log = logging.getLogger(__name__)


class _FollowerProgress:
    """A tensor-parallel rank other than the first: the first rank's finished questions, nothing recorded."""

    def __init__(self, done: dict):
        self.done = done

    def append(self, question_id: str, records: list) -> None:
        pass


def main(cfg) -> dict:
    if cfg.eval.compare:  # several drafters side by side (compare.py)
        return compare.main(cfg)
    t0 = time.perf_counter()
    out_dir = cfg.stage_dir("eval")
    layout = target_layout(cfg.target.tensor_parallel)
    if layout.sharded and layout.data_world != 1:
        raise ValueError(f"eval decodes one request at a time on one target: run it on target.tensor_parallel="
                         f"{layout.tp} ranks, not {layout.world_size}")
    target = load_target(rank_target_config(cfg.target, rank_info()) if layout.sharded else cfg.target)
    drafter, drafter_info, inputs = build_drafter(cfg, target)
    drafter = lockstep(drafter, layout)  # a tensor-parallel group verifies its first rank's trees
    report = BadRecordReport()
    questions = load_questions(cfg.eval.questions, cfg.eval.limit, report, cfg.data.on_bad_record,
                               cfg.data.max_turn_chars)
    settings = {"top_k": cfg.tree.top_k, "depth": cfg.tree.depth, "total_tokens": cfg.tree.total_tokens,
                "temperature": cfg.eval.temperature, "max_new_tokens": cfg.eval.max_new_tokens,
                "device": str(target.device), "dtype": target.precision,
                "questions": cfg.eval.questions or "demo", "head": cfg.eval_subject,
                **({"chat_template": cfg.target.chat_template} if cfg.target.chat_template else {}),
                **({"thinking": str(cfg.regen.thinking)} if cfg.regen.thinking != "template" else {})}
    identity = {"settings": settings, "seed": cfg.eval.seed, "baseline": cfg.eval.baseline,
                "baseline_limit": cfg.eval.baseline_limit, "system_prompt": cfg.data.system_prompt,
                "greedy_check": cfg.eval.greedy_check,  # a resumed run never mixes checked and unchecked turns
                **({"head_manifest_sha256": sha256_file(inputs[0] / MANIFEST)} if inputs else
                   {"drafter": drafter_info}),
                "questions_sha256": hashlib.sha256(json.dumps([[q.id, q.system, q.turns] for q in questions])
                                                   .encode()).hexdigest()}
    # Only the first rank of a tensor-parallel target reads and writes the partial answers; the others answer
    # what it has not answered yet.
    progress = EvalProgress(out_dir, identity, cfg.eval.overwrite) if layout.is_writer else None
    if layout.sharded:
        done = layout.agree(progress.done if progress is not None else None)
        progress = progress or _FollowerProgress(done)
    choice = None
    if cfg.tree.is_auto:
        choice = tree_choice(cfg, target, drafter, questions, out_dir, resumed=bool(progress.done), layout=layout)
    tree = cfg.tree.spec(choice["depth"], choice["total_tokens"]) if choice else cfg.tree.spec()
    deadline = None if cfg.eval.time_budget_s is None else time.monotonic() + cfg.eval.time_budget_s
    records = answer_questions(target, drafter, questions, cfg.eval, tree,
                               system_prompt=cfg.data.system_prompt, thinking=cfg.regen.thinking,
                               progress=progress, deadline=deadline,
                               fp32_model=fp32_baseline_model(cfg, target), agree=layout.agree)
    # A draft path holds up to depth + 1 tokens (EAGLE's round 0 plus `depth` expansions): report every level.
    summary = summarize(records, settings, tree.depth + 1, cfg.eval.loop_share)
    if choice is not None:
        summary["tree_choice"] = choice
    n_done = len({r.question_id for r in records})
    summary.update(questions=len(questions), questions_done=n_done, complete=n_done == len(questions))
    summary["target"] = target.fingerprint
    summary["head"] = drafter_info
    if inputs:  # the train run it evaluated, as a model card matches them
        summary["head_manifest_sha256"] = identity["head_manifest_sha256"]
    summary["machine"] = machine_description(target.device)  # where this run finished (its speed figures)
    if not layout.is_writer:  # a tensor-parallel target's other ranks decoded in lockstep; the first writes
        return summary
    if layout.sharded:
        summary["tensor_parallel"] = layout.tp
    subject = f"{cfg.name}/{cfg.eval_subject}/{cfg.eval_run_name}"
    if not summary["complete"]:  # no answers.jsonl or manifest: the next stage must not take a partial eval
        atomic_write_text(out_dir / "summary.partial.json", json.dumps(to_plain(summary), indent=2) + "\n")
    else:
        (out_dir / "summary.partial.json").unlink(missing_ok=True)
        # Atomic: a kill mid-write never leaves a torn answers.jsonl or summary.json for a reader to trust.
        atomic_write_text(out_dir / "answers.jsonl",
                          "".join(json.dumps(record_dict(rec), ensure_ascii=False) + "\n" for rec in records))
        atomic_write_text(out_dir / "summary.json", json.dumps(to_plain(summary), indent=2) + "\n")
        plot_summary(summary, out_dir / "tau.png", title=subject.replace("/", " / "))
        log_wandb(cfg.wandb, out_dir, summary, subject.replace("/", "-"),
                  to_plain({"eval": cfg.eval, "tree": cfg.tree, "head": cfg.head, "target": cfg.target}))
        write_manifest(out_dir, "eval", config={"eval": cfg.eval, "tree": cfg.tree, "head": cfg.head,
                                                "target": cfg.target},
                       counts={"questions": len(questions), "turns": len(records),
                               "new_tokens": summary["new_tokens"], "bad_records": report.to_dict()},
                       timings={"total_s": time.perf_counter() - t0, "spec_wall_s": summary["spec_wall_s"]},
                       inputs=inputs, target=target.fingerprint, precision=target.precision,
                       tau=summary["tau"],
                       speedup=summary.get("speedup"))
    print(f"[eval] {subject} -> {out_dir}\n{format_summary(summary)}")
    return summary
