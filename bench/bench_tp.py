"""Dump throughput with a tensor-parallel target (`target.tensor_parallel=N`) against one whole replica.

The same dump (the alpaca demo conversations, `dump.input=data`) runs twice through the CLI: TP=1 as one process
with every core's threads, and TP=N as N torchrun processes (gloo on CPU, NCCL on GPUs) sharing the cores. It
reports the dump's own rate (tokens over the seconds spent in shards, the manifest's `timings.tokens_per_s`) and
the wall time of the whole command (startup and target load included), and checks the two dumps agree.

    python -m bench.bench_tp                          # a synthetic Llama (8 heads / 4 kv heads), TP 2
    python -m bench.bench_tp --target smollm2 --tp 3  # SmolLM2-135M: 9 heads / 3 kv heads, so TP 3 (not 2)

On a 2-core CPU both runs share the same 2 cores, so TP cannot be faster there: the figure is the cost of the
collectives (two all-reduces per layer over gloo), not a speedup. TP is for a target that does not fit one device.
Measured on this 2-core CPU (fp32; bench/results/tp_dump.json, tp_dump_smollm2.json):
    synthetic Llama, 200 rows (71,092 tokens): TP=1 1,444 tokens/s, TP=2 1,319 tokens/s (0.91x); states within 3.3e-6
    SmolLM2-135M, 100 rows (20,701 tokens):   TP=1 421 tokens/s,   TP=3 327 tokens/s (0.78x, 3 processes on 2 cores)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "alpaca_en_demo" / "alpaca_en_demo.json"


def synthetic_llama(path: Path, hidden: int, layers: int, heads: int, kv_heads: int) -> None:
    """A seeded random Llama with the suite's tiny tokenizer and chat template, saved to `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model.save_pretrained(path)
    tok.save_pretrained(path)


def dump(root: Path, target: list[str], rows: int, tp: int, cores: int) -> dict:
    launcher = [sys.executable] if tp == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                 "--nproc-per-node", str(tp)]
    threads = max(1, cores // tp)
    cmd = launcher + ["-m", "pipeline.run", "stage=dump", f"output_root={root}", "name=bench", *target,
                      "dump.input=data", "data.name=bench", "data.max_length=512", "wandb.mode=disabled",
                      f"data.sources=[{{path: {DATA}, limit: {rows}}}]", f"target.tensor_parallel={tp}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    manifest = json.loads((root / "bench" / "dump" / "manifest.json").read_text())
    return {"tensor_parallel": tp, "processes": tp, "threads_per_process": threads,
            "tokens": manifest["totals"]["tokens"], "dump_tokens_per_s": round(manifest["timings"]["tokens_per_s"], 1),
            "shard_seconds": round(manifest["timings"]["shard_seconds"], 2), "wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["synthetic", "smollm2"], default="synthetic")
    ap.add_argument("--tp", type=int, default=None, help="default: 2 (synthetic), 3 (smollm2)")
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=None, help="default: bench/results/tp_dump[_smollm2].json")
    args = ap.parse_args()
    tp = args.tp or (3 if args.target == "smollm2" else 2)
    out = args.out or str(REPO / "bench" / "results" / f"tp_dump{'_smollm2' if args.target == 'smollm2' else ''}.json")
    with tempfile.TemporaryDirectory(prefix="eaglet-bench-tp-") as tmp:
        tmp = Path(tmp)
        if args.target == "smollm2":
            target, label = ["target.dtype=float32"], "SmolLM2-135M-Instruct (9 heads / 3 kv heads), fp32"
        else:
            synthetic_llama(tmp / "model", args.hidden, args.layers, 8, 4)
            target = ["target=hf", f"target.path={tmp / 'model'}", "target.name=synthetic", "target.dtype=float32"]
            label = f"synthetic Llama (hidden {args.hidden}, {args.layers} layers, 8 heads / 4 kv heads), fp32"
        runs = [dump(tmp / f"tp{n}", target, args.rows, n, args.cores) for n in (1, tp)]
        from pipeline.hidden_states.reader import DumpReader

        a, b = (DumpReader(tmp / f"tp{n}" / "bench" / "dump") for n in (1, tp))
        worst = max(float((a[i].final_hidden - b[i].final_hidden).abs().max()) for i in range(len(a)))
    result = {"target": label, "rows": args.rows, "cores": args.cores, "runs": runs,
              "tp_over_tp1_dump_rate": round(runs[1]["dump_tokens_per_s"] / runs[0]["dump_tokens_per_s"], 3),
              "max_final_state_diff": worst}
    print(json.dumps(result, indent=1))
    Path(out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
