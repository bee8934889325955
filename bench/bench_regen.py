"""Regen benchmark on the real target (SmolLM2-135M, CPU): generated tokens/s of the hf backend at batch 16
(left-padded, one `generate` per batch, as regen runs it) over answering the same prompts one at a time, in
the same process. Counts only real answer tokens (up to and including the end-of-turn token), never padding.
Also reports how many answers are identical both ways at temperature 0 and, for the others, the first token
where they diverge (fp32 near-ties flipped by the padded batch's different matmul shapes).

    flock /tmp/eaglet-cpu.lock python bench/bench_regen.py        # ~2-3 minutes on 2 cores
Writes bench/results/regen.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from pipeline.data.bad_records import BadRecordReport  # noqa: E402
from pipeline.data.config import DataConfig  # noqa: E402
from pipeline.data.readers import read_sources  # noqa: E402
from pipeline.regen.batching import to_items  # noqa: E402
from pipeline.regen.hf_backend import HFBackend  # noqa: E402
from pipeline.regen.waves import Request  # noqa: E402
from pipeline.target import TargetConfig, load_target  # noqa: E402


def timed_generate(backend: HFBackend, requests: list[Request]):
    t0 = time.perf_counter()
    answers = backend.generate(requests)
    return answers, time.perf_counter() - t0


def rate(answers, seconds: float) -> dict:
    tokens = sum(a.n_tokens for a in answers)
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "regen.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target = load_target(TargetConfig())
    backend = HFBackend(target, max_new_tokens=args.max_new_tokens)
    # The first user turn of the first `batch_size` demo prompts (the shipped MT-bench-style file).
    items = to_items(read_sources(DataConfig(), BadRecordReport()), limit=args.batch_size)
    requests = [Request(item.first_prompt(), seed=0) for item in items]
    backend.generate(requests[:2])  # warm-up: allocator, kernels

    batched, batched_s = timed_generate(backend, requests)
    alone, alone_s = [], 0.0
    for request in requests:
        [answer], seconds = timed_generate(backend, [request])
        alone.append(answer)
        alone_s += seconds

    b, a = rate(batched, batched_s), rate(alone, alone_s)
    divergence = []
    for req, x, y in zip(requests, batched, alone):
        if x.text != y.text:
            xs, ys = backend.tokenizer.encode(x.text), backend.tokenizer.encode(y.text)
            first = next((i for i, (p, q) in enumerate(zip(xs, ys)) if p != q), min(len(xs), len(ys)))
            divergence.append(first)
    result = {
        "target": target.fingerprint["name"],
        "device": str(target.device), "dtype": str(target.dtype), "threads": args.threads,
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "prompts": len(requests), "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
        "prompt_tokens": [len(backend.prompt_ids(r.messages)) for r in requests],
        "batched": b, "one_at_a_time": a,
        "speedup_tokens_per_s": round(b["tokens_per_s"] / a["tokens_per_s"], 2),
        "identical_answers": len(requests) - len(divergence),
        "first_divergent_token": sorted(divergence),
        "truncated_answers": {"batched": sum(x.finish_reason == "length" for x in batched),
                              "one_at_a_time": sum(x.finish_reason == "length" for x in alone)},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
