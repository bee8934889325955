"""How long a training checkpoint blocks the loop, written synchronously and in the background (train.async_save),
measured on this machine for an EAGLE-3 head of SmolLM2-135M's size, and what that makes of a Llama-3.1-70B head's.

The head is built from its config (hidden 576, 9/3 heads, intermediate 1536, target vocab 49152, draft vocab
32000; no target weights needed), one AdamW step in so the optimizer holds its two fp32 moments per parameter.
The real writer (pipeline/train/checkpoint.py CheckpointWriter, one process) then saves it `--repeats` times each
way, interleaved:
  - sync: `save` returns once the checkpoint is whole: snapshot, write, fsync, sha256, record, rename. That is
    the loop's stall at every scheduled checkpoint, and what a stop request (SIGTERM/SIGUSR1) must finish
    before the process may exit.
  - async: `save` returns after the CPU-memory snapshot; the rest runs in a thread (timed by the `wait` after).
The 70B figures scale the measured rates to the 70B head's bytes (hidden 8192, 64/8 heads, intermediate 28672,
target vocab 128256, draft vocab 32000: its trainable parameters counted on the meta device, 12 bytes each in a
checkpoint: fp32 weights and Adam's two fp32 moments). They hold for this machine's disk and one writer thread;
on a GPU the snapshot is a device-to-host copy instead of a memcpy.

    python -m bench.bench_checkpoint            # about 30 s on 2 cores; writes bench/results/checkpoint.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pipeline.files import sha256_file
from pipeline.heads import build_draft_head
from pipeline.heads.config import DraftHeadConfig
from pipeline.heads.io import frozen_names
from pipeline.precision import cpu_description
from pipeline.train import checkpoint as ckpt
from pipeline.train.config import TrainConfig
from pipeline.train.parallel import Parallel
from tests.support.holder import Holder

REPO = Path(__file__).resolve().parents[1]

SMOLLM2 = DraftHeadConfig(kind="eagle3", aux_layer_ids=[2, 15, 27])  # the defaults are SmolLM2-135M's dimensions
LLAMA_70B = DraftHeadConfig(kind="eagle3", hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                            head_dim=128, intermediate_size=28672, vocab_size=128256, draft_vocab_size=32000,
                            target_hidden_size=8192, aux_layer_ids=[2, 40, 77], max_position_embeddings=131072)
BYTES_PER_PARAMETER = 12  # fp32 weights + AdamW's exp_avg and exp_avg_sq, fp32


def trainable_parameters(cfg: DraftHeadConfig) -> int:
    """Counted without memory: built on the meta device."""
    with torch.device("meta"):
        head = build_draft_head(cfg)
    frozen = frozen_names(head)
    return sum(p.numel() for n, p in head.named_parameters() if n not in frozen)


def training_state(par: Parallel):
    torch.manual_seed(0)
    head = build_draft_head(SMOLLM2)
    model = Holder(head)
    params = [p for p in head.parameters() if p.requires_grad]  # the frozen target copies are not saved
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    sum(p.float().square().sum() for p in params).backward()
    model, optimizer = par.prepare(model, optimizer)
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default=None, help="write the checkpoints here (default: a temporary folder)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "checkpoint.json"))
    args = ap.parse_args()

    par = Parallel(TrainConfig(mixed_precision="no"))
    try:
        model, optimizer, scheduler = training_state(par)
        work = Path(args.work or tempfile.mkdtemp(prefix="eaglet-checkpoint-"))
        sync = ckpt.CheckpointWriter(work / "sync", par, keep=1)
        background = ckpt.CheckpointWriter(work / "async", par, keep=1, background=True)
        times = {"sync_blocked_s": [], "async_blocked_s": [], "async_whole_s": []}
        for i in range(args.repeats):  # interleaved: the machine's drift hits both alike
            t0 = time.perf_counter()
            sync.save(model, optimizer, scheduler, {"step": i + 1})
            times["sync_blocked_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            background.save(model, optimizer, scheduler, {"step": i + 1})
            times["async_blocked_s"].append(time.perf_counter() - t0)
            background.wait()
            times["async_whole_s"].append(time.perf_counter() - t0)
    finally:
        par.end()

    last = ckpt.latest_checkpoint(work / "sync")
    files = [p for p in last.rglob("*") if p.is_file()]
    nbytes = sum(p.stat().st_size for p in files)
    t0 = time.perf_counter()
    for p in files:
        sha256_file(p)
    hash_s = time.perf_counter() - t0  # warm page cache: the hashing alone

    med = {k: statistics.median(v) for k, v in times.items()}
    small_params, big_params = trainable_parameters(SMOLLM2), trainable_parameters(LLAMA_70B)
    big_bytes = big_params * BYTES_PER_PARAMETER
    save_rate, snapshot_rate = nbytes / med["sync_blocked_s"], nbytes / med["async_blocked_s"]
    hash_rate = nbytes / hash_s
    result = {
        "machine": cpu_description(), "threads": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "smollm2_head": {"trainable_parameters": small_params, "checkpoint_bytes": nbytes,
                         "files": {str(p.relative_to(last)): p.stat().st_size for p in files}},
        "seconds": times, "median_s": med,
        "rates_GB_per_s": {"sync_save": save_rate / 1e9, "async_snapshot": snapshot_rate / 1e9,
                           "sha256_warm": hash_rate / 1e9},
        "llama_70b_head": {"trainable_parameters": big_params, "checkpoint_bytes": big_bytes,
                           "sync_save_s": big_bytes / save_rate, "async_blocked_s": big_bytes / snapshot_rate,
                           "sha256_s": big_bytes / hash_rate},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    b = result["llama_70b_head"]
    print(f"{cpu_description()}, {os.cpu_count()} cores; median of {args.repeats}")
    print(f"EAGLE-3 head of SmolLM2-135M's size: {small_params / 1e6:.1f}M trainable parameters, checkpoint "
          f"{nbytes / 1e6:.0f} MB")
    print(f"{'':24}{'loop blocked':>14}{'checkpoint whole':>18}")
    print(f"{'sync save':24}{med['sync_blocked_s']:>12.2f} s{med['sync_blocked_s']:>16.2f} s")
    print(f"{'async save':24}{med['async_blocked_s']:>12.2f} s{med['async_whole_s']:>16.2f} s")
    print(f"rates: sync save {save_rate / 1e9:.2f} GB/s (write, fsync, sha256), snapshot "
          f"{snapshot_rate / 1e9:.2f} GB/s, sha256 alone {hash_rate / 1e9:.2f} GB/s")
    print(f"Llama-3.1-70B EAGLE-3 head: {big_params / 1e9:.2f}B trainable parameters, checkpoint "
          f"{big_bytes / 1e9:.1f} GB: sync save (and a stop request's) {b['sync_save_s']:.0f} s, of which sha256 "
          f"{b['sha256_s']:.0f} s; async blocks the loop {b['async_blocked_s']:.1f} s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
