"""Stage eval: tau and speedup of a trained head with the tree speculative decoder."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time

from pipeline.data.bad_records import BadRecordReport
from pipeline.eval.evaluate import answer_questions, record_dict
from pipeline.eval.progress import EvalProgress
from pipeline.eval.questions import load_questions
from pipeline.eval.report import format_summary, log_wandb, plot_summary, summarize
from pipeline.heads.io import load_head
from pipeline.manifest import MANIFEST, digest_file, load_manifest, to_plain, write_manifest
from pipeline.target import load_target

log = logging.getLogger(__name__)


def fp32_baseline_model(cfg, target):
    """On CPU, vanilla decoding of a reduced-precision target is timed in fp32 too: one-token forwards
    can be slower in bf16 there (measured: 18.0 against 26.5 tokens/s), and speedup must be measured
    against the fastest vanilla decoding. GPUs decode fastest in bf16: no copy."""
    if not cfg.eval.baseline or target.device.type != "cpu" or target.precision == "float32":
        return None
    return load_target(dataclasses.replace(cfg.target, dtype="float32")).model


def main(cfg) -> dict:
    t0 = time.perf_counter()
    train_dir, out_dir = cfg.stage_dir("train"), cfg.stage_dir("eval")
    train_manifest = load_manifest(train_dir, expect_stage="train")
    target = load_target(cfg.target)
    head = load_head(train_dir, target)  # refuses a head trained on another target
    report = BadRecordReport()
    questions = load_questions(cfg.eval.questions, cfg.eval.limit, report, cfg.data.on_bad_record)
    settings = {"top_k": cfg.tree.top_k, "depth": cfg.tree.depth, "total_tokens": cfg.tree.total_tokens,
                "temperature": cfg.eval.temperature, "max_new_tokens": cfg.eval.max_new_tokens,
                "device": str(target.device), "dtype": target.precision,
                "questions": cfg.eval.questions or "demo", "head": cfg.head.name}
    identity = {"settings": settings, "seed": cfg.eval.seed, "baseline": cfg.eval.baseline,
                "baseline_limit": cfg.eval.baseline_limit, "system_prompt": cfg.data.system_prompt,
                "head_manifest_sha256": digest_file(train_dir / MANIFEST),
                "questions_sha256": hashlib.sha256(json.dumps([[q.id, q.system, q.turns] for q in questions])
                                                   .encode()).hexdigest()}
    progress = EvalProgress(out_dir, identity, cfg.eval.overwrite)
    deadline = None if cfg.eval.time_budget_s is None else time.monotonic() + cfg.eval.time_budget_s
    records = answer_questions(target, head, questions, cfg.eval, cfg.tree, system_prompt=cfg.data.system_prompt,
                               progress=progress, deadline=deadline, fp32_model=fp32_baseline_model(cfg, target))
    # A draft path holds up to depth + 1 tokens (EAGLE's round 0 plus `depth` expansions): report every level.
    summary = summarize(records, settings, cfg.tree.depth + 1)
    n_done = len({r.question_id for r in records})
    summary.update(questions=len(questions), questions_done=n_done, complete=n_done == len(questions))
    summary["target"] = target.fingerprint
    summary["head"] = {"name": cfg.head.name, "kind": head.config.kind,
                       "train_manifest_code_version": train_manifest.get("code_version"),
                       "config": head.config.to_dict()}
    if not summary["complete"]:  # no answers.jsonl or manifest: the next stage must not take a partial eval
        (out_dir / "summary.partial.json").write_text(json.dumps(to_plain(summary), indent=2) + "\n")
    else:
        (out_dir / "summary.partial.json").unlink(missing_ok=True)
        with open(out_dir / "answers.jsonl", "w") as f:
            for rec in records:
                f.write(json.dumps(record_dict(rec), ensure_ascii=False) + "\n")
        (out_dir / "summary.json").write_text(json.dumps(to_plain(summary), indent=2) + "\n")
        plot_summary(summary, out_dir / "tau.png", title=f"{cfg.name} / {cfg.head.name} / {cfg.eval_run_name}")
        log_wandb(cfg.wandb, out_dir, summary, f"{cfg.name}-{cfg.head.name}-{cfg.eval_run_name}",
                  to_plain({"eval": cfg.eval, "tree": cfg.tree, "head": cfg.head, "target": cfg.target}))
        write_manifest(out_dir, "eval", config={"eval": cfg.eval, "tree": cfg.tree, "head": cfg.head,
                                                "target": cfg.target},
                       counts={"questions": len(questions), "turns": len(records),
                               "new_tokens": summary["new_tokens"], "bad_records": report.to_dict()},
                       timings={"total_s": time.perf_counter() - t0, "spec_wall_s": summary["spec_wall_s"]},
                       inputs=[train_dir], target=target.fingerprint, precision=target.precision,
                       tau=summary["tau"],
                       speedup=summary.get("speedup"))
    print(f"[eval] {cfg.name}/{cfg.head.name}/{cfg.eval_run_name} -> {out_dir}\n{format_summary(summary)}")
    return summary
