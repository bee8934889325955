"""Stage dump: `python -m pipeline.run stage=dump experiment=<name>` (one process per rank under torchrun or
Slurm). Reads regen's conversations (or the data sources), writes `outputs/<experiment>/dump/`."""
from __future__ import annotations

import logging

from pipeline.data.bad_records import BadRecordReport
from pipeline.dist import rank_info, rank_target_config, target_layout
from pipeline.hidden_states.dump import DumpSummary, dump_hidden_states
from pipeline.hidden_states.inputs import read_conversations, tokenize_all
from pipeline.hidden_states.reader import REPAIR, DumpReader, verify_dump
from pipeline.hidden_states.tokens import tokenized_input
from pipeline.manifest import MANIFEST, ManifestError
from pipeline.target import load_target

log = logging.getLogger(__name__)


class DumpVerifyError(RuntimeError):
    pass


def main(cfg) -> DumpSummary:
    if cfg.dump.plan_only:
        return plan_only(cfg)
    rank = rank_info()
    tp = target_layout(cfg.target.tensor_parallel, rank)  # refuses a world size N does not divide, before loading
    target = load_target(rank_target_config(cfg.target, rank))

    rows = tokenized_input(cfg, target, "dump")  # tokenized once, by the first rank; the others map its arrays

    out_dir = cfg.stage_dir("dump")
    summary = dump_hidden_states(
        target, rows.samples, cfg.dump, out_dir, rank=rank, target_layout=tp,
        manifest_extra={"config": {"dump": cfg.dump, "data": cfg.data, "target": cfg.target},
                        "counts": dict(rows.counts), "inputs": rows.inputs, "bad_records": rows.bad_records,
                        "thinking": cfg.regen.thinking})  # the rows' template mode: train and eval check it
    log.info("%s", summary)

    if cfg.dump.verify and summary.manifest is not None:
        problems = verify_dump(out_dir, force=True)  # really re-reads what was written (and records it)
        if problems:
            raise DumpVerifyError(f"dump.verify: {len(problems)} bad shard(s) in {out_dir}:\n  " + "\n  ".join(problems)
                                  + f"\n{REPAIR}")
        log.info("dump.verify: all %d shards match their sha256", summary.shards)
    if summary.manifest is not None:  # the row index, built once here and cached (index/) for every reader
        DumpReader(out_dir, verify=False)
    return summary


def plan_only(cfg) -> dict:
    """`dump.plan_only=true`: the dump's size before anything runs, from the target's config, tokenizer and parts
    (never the model) and the tokenized input; writes <dump dir>/plan.json and prints the table."""
    import json

    from pipeline.hidden_states.dump import plan_dump
    from pipeline.hidden_states.sizing import format_plan, size_plan
    from pipeline.target import load_target_parts

    target = load_target_parts(cfg.target)
    report = BadRecordReport()
    source = "the regen output" if str(cfg.dump.input) == "regen" else "the data sources"
    try:
        conversations, _ = read_conversations(cfg, target.fingerprint, report)
    except ManifestError:
        if not (cfg.stage_dir("regen") / MANIFEST).exists():  # before regen: the sources' own answers stand in
            from pipeline.data.readers import read_sources

            conversations, source = read_sources(cfg.data, report), "the data sources' own answers (regen has not run)"
        else:
            raise
    samples, counts = tokenize_all(conversations, target.tokenizer, cfg.data, cfg.dump.limit,
                                   thinking=cfg.regen.thinking)
    if not samples:
        raise RuntimeError(f"dump.plan_only: nothing to size in {source}: no conversation with an assistant answer "
                           f"({dict(counts)}); prompt-only data is sized after regen")
    log.info("dump.plan_only: sized from %s", source)
    layout, plan = plan_dump(target, samples, cfg.dump)
    compute = "bfloat16" if target.precision == "float32" else target.precision  # a GPU cluster computes in bf16
    sizing = size_plan(target.model.config, sum(plan.shard_tokens), len(samples), layout.layer_ids,
                       cfg.dump.shard_bytes, cfg.dump.batch_tokens, getattr(cfg.target, "tensor_parallel", 1),
                       rank_info().world_size, compute, head_kind=str(cfg.head.kind),
                       draft_vocab_size=getattr(cfg.head, "draft_vocab_size", None),
                       micro_batch_tokens=cfg.train.micro_batch_tokens, planned_shards=len(plan.shards))
    sizing["counts"], sizing["sized_from"] = dict(counts), source
    out = cfg.stage_dir("dump")
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(sizing, indent=1))
    print(format_plan(sizing))
    return sizing
