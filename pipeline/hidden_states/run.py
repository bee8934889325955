"""Stage dump: `python -m pipeline.run stage=dump experiment=<name>` (one process per rank under torchrun or
Slurm). Reads regen's conversations (or the data sources), writes `outputs/<experiment>/dump/`."""
from __future__ import annotations

import logging

from pipeline.data.bad_records import BadRecordReport
from pipeline.dist import rank_info, rank_target_config
from pipeline.hidden_states.dump import DumpSummary, dump_hidden_states
from pipeline.hidden_states.inputs import read_conversations, tokenize_all
from pipeline.hidden_states.reader import REPAIR, verify_dump
from pipeline.target import load_target

log = logging.getLogger(__name__)


class DumpVerifyError(RuntimeError):
    pass


def main(cfg) -> DumpSummary:
    rank = rank_info()
    target = load_target(rank_target_config(cfg.target, rank))

    report = BadRecordReport()
    conversations, inputs = read_conversations(cfg, target.fingerprint, report)
    samples, counts = tokenize_all(conversations, target.tokenizer, cfg.data, cfg.dump.limit)
    if report.total or report.fixes:
        log.warning("dump input: %s", report.summary())
    if not samples:
        raise RuntimeError(f"dump: no conversation with an assistant turn in the input ({dict(counts)})")

    out_dir = cfg.stage_dir("dump")
    summary = dump_hidden_states(
        target, samples, cfg.dump, out_dir, rank=rank,
        manifest_extra={"config": {"dump": cfg.dump, "data": cfg.data, "target": cfg.target},
                        "counts": dict(counts), "inputs": inputs, "bad_records": report.to_dict()})
    log.info("%s", summary)

    if cfg.dump.verify and summary.manifest is not None:
        problems = verify_dump(out_dir)
        if problems:
            raise DumpVerifyError(f"dump.verify: {len(problems)} bad shard(s) in {out_dir}:\n  " + "\n  ".join(problems)
                                  + f"\n{REPAIR}")
        log.info("dump.verify: all %d shards match their sha256", summary.shards)
    return summary
