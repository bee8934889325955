"""What checking a dump's shards costs, against what training on them costs, in one run on this machine.

Every reader of a dump checks each shard's sha256 against the manifest before it reads a row
(`pipeline/hidden_states/reader.py`, opt-out `train.verify_inputs=false`). Both that check and a training
epoch grow with the dump's tokens, so their ratio at the quality experiment's scale is the ratio measured
here on a dump of the same shape: the real SmolLM2 target, its fused layers in the dump dtype `auto` picks
(bf16 on a CPU with fast bf16), EAGLE-3 with the quality experiment's 7 TTT rounds and 4,096-token
micro-batches. Measured side by side:
  - opening the dump with and without the digests, interleaved `--repeats` times, warm page cache (the dump
    was just written), and once after dropping the page cache (as root; a 10 GB dump read from disk);
  - one training epoch's step time (the sum over its steps of tokens / tokens_per_s: optimizer steps only,
    no model load or validation).
Target: verifying costs at most 5% of one epoch. Writes bench/results/integrity.json.

    python -m bench.bench_integrity --conversations 60     # about 3 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.config import EagletConfig
from pipeline.data.config import DataConfig, SourceConfig
from pipeline.heads import Eagle3HeadConfig
from pipeline.hidden_states.config import DumpConfig
from pipeline.hidden_states.reader import DumpReader, verify_shards
from pipeline.precision import cpu_description
from pipeline.target import TargetConfig
from pipeline.train.config import TrainConfig
from pipeline.train.data import split_train_val, truncated_lengths

REPO = Path(__file__).resolve().parents[1]

SHARED = REPO.parent / "shared" / "data"
SOURCE = SHARED / "sharegpt_sg92k_sample1000" / "sharegpt_1000.json"  # real multi-turn ShareGPT with answers
QUALITY_TOKENS = 1_700_000  # the quality v2 experiment's answer tokens (docs/results/quality.md)


def config(work: Path, conversations: int) -> EagletConfig:
    return EagletConfig(
        name="integrity", output_root=str(work), target=TargetConfig(),
        data=DataConfig(sources=[SourceConfig(path=str(SOURCE), limit=conversations)], max_length=2048),
        dump=DumpConfig(input="data", shard_bytes=64 << 20), head=Eagle3HeadConfig(ttt_steps=7, draft_vocab_size=16000),
        train=TrainConfig(epochs=1, micro_batch_tokens=4096, warmup_steps=2, save_every=0, eval_every=0,
                          tau_prompts=0, plot=False, lr=1e-3, val_max_batches=1))


def open_seconds(dump_dir: Path, verify: bool) -> float:
    """Opening the dump, and with `verify` hashing every shard (forced: a reader trusts the shards verified
    unchanged before, so this is the cost of a first start, or of dump.verify)."""
    t0 = time.perf_counter()
    DumpReader(dump_dir, verify=False)
    if verify:
        assert verify_shards(dump_dir, force=True).problems == []
    return time.perf_counter() - t0


def drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--work", default=None, help="keep the dump and head here (default: a temporary folder)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "integrity.json"))
    args = ap.parse_args()

    from pipeline.hidden_states import run as dump_run
    from pipeline.train import run as train_run

    work = Path(args.work or tempfile.mkdtemp(prefix="eaglet-integrity-"))
    cfg = config(work, args.conversations)
    dump_dir, train_dir = cfg.stage_dir("dump"), cfg.stage_dir("train")
    if not (dump_dir / "manifest.json").is_file():
        dump_run.main(cfg)
    manifest = json.loads((dump_dir / "manifest.json").read_text())
    tokens, dump_bytes = manifest["counts"]["tokens"], sum(s["bytes"] for s in manifest["shards"])

    plain, checked = [], []
    for _ in range(args.repeats):  # interleaved: the machine's drift hits both alike
        plain.append(open_seconds(dump_dir, verify=False))
        checked.append(open_seconds(dump_dir, verify=True))
    cold = None
    if drop_page_cache():
        cold_checked = open_seconds(dump_dir, verify=True)
        drop_page_cache()
        cold = {"checked_s": cold_checked, "plain_s": open_seconds(dump_dir, verify=False)}

    if not (train_dir / "manifest.json").is_file():
        train_run.main(cfg)
    # An epoch's step time: its training rows' tokens (as truncated for training) over the steps' mean rate.
    records = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    lengths = truncated_lengths(DumpReader(dump_dir, verify=False).lengths, cfg.train.max_length)
    train_rows = split_train_val(len(lengths), cfg.train.val_fraction, cfg.train.seed)[0]
    epoch_s = sum(int(lengths[i]) for i in train_rows) / statistics.mean(rates)

    extra_warm = statistics.median(checked) - statistics.median(plain)
    result = {
        "machine": cpu_description(), "threads": os.cpu_count(),
        "dump": {"conversations": args.conversations, "tokens": tokens, "bytes": dump_bytes,
                 "dtype": manifest["dtype"], "shards": len(manifest["shards"])},
        "open_s": {"plain_median": statistics.median(plain), "checked_median": statistics.median(checked),
                   "plain": plain, "checked": checked},
        "sha256_GB_per_s_warm": dump_bytes / 1e9 / max(extra_warm, 1e-9),
        "cold_cache": cold,
        "epoch": {"train_steps": len(rates), "tokens_per_s_mean": statistics.mean(rates), "seconds": epoch_s},
        "verify_over_epoch_warm": extra_warm / epoch_s,
        "verify_over_epoch_cold": (cold["checked_s"] - cold["plain_s"]) / epoch_s if cold else None,
        "at_quality_scale": {"tokens": QUALITY_TOKENS,
                             "dump_GB": dump_bytes / tokens * QUALITY_TOKENS / 1e9,
                             "verify_s_warm": extra_warm / tokens * QUALITY_TOKENS,
                             "epoch_s": epoch_s / tokens * QUALITY_TOKENS},
        "target_max": 0.05,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("dump", "open_s", "cold_cache", "epoch", "verify_over_epoch_warm",
                                             "verify_over_epoch_cold", "at_quality_scale")}, indent=2))
    ok = max(result["verify_over_epoch_warm"], result["verify_over_epoch_cold"] or 0) <= result["target_max"]
    print(f"verify / epoch: {result['verify_over_epoch_warm']:.4f} warm, "
          f"{result['verify_over_epoch_cold'] if cold else float('nan'):.4f} cold (target <= 0.05): "
          f"{'met' if ok else 'MISSED'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
