"""CUDA check of the decoding path: SmolLM2 in bf16 on the GPU, tree decoding (oracle drafter with wrong
siblings) against HF greedy generate, then the real demo head's tau and speedup. Prints one table and
writes bench/results/gpu_check.json. Usage: python bench/gpu_check.py [--device cuda] [--head-dir DIR]"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from pipeline.data.chat import render_prompt
from pipeline.eval.decoder import generate, vanilla_generate
from pipeline.eval.drafter import EagleDrafter, OracleDrafter
from pipeline.eval.evaluate import stop_token_ids
from pipeline.target import TargetConfig, load_target

PROMPTS = ["Explain how a hash map works.", "Write a short story about a lighthouse keeper.",
           "List five uses of a paperclip and explain each."]


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)) if len(a) != len(b) else -1)


def lossless_rows(target, max_new_tokens: int) -> list[dict]:
    rows = []
    for prompt_text in PROMPTS:
        ids = torch.tensor(render_prompt(target.tokenizer, [{"role": "user", "content": prompt_text}]))
        with torch.no_grad():
            ref = target.model.generate(ids[None].to(target.device), do_sample=False, max_new_tokens=max_new_tokens,
                                        min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
        ref_new = ref[0, ids.numel():].tolist()
        drafter = OracleDrafter(ids.tolist() + ref_new, target.model.config.vocab_size, miss_rate=0.1)
        res = generate(target.model, drafter, ids, max_new_tokens, eos_token_ids=())
        rows.append({"check": "oracle tree vs HF greedy", "prompt": prompt_text[:30], "tau": round(res.tau, 2),
                     "identical": res.tokens == ref_new, "first_divergence": first_divergence(res.tokens, ref_new)})
    return rows


def head_rows(target, head_dir: Path, max_new_tokens: int) -> list[dict]:
    from pipeline.train.checkpoint import load_head

    head = load_head(head_dir, target)
    eos = stop_token_ids(target.model, target.tokenizer)
    rows = []
    for prompt_text in PROMPTS:
        ids = torch.tensor(render_prompt(target.tokenizer, [{"role": "user", "content": prompt_text}]))
        generate(target.model, EagleDrafter(head), ids, 8, eos_token_ids=eos)  # warm-up (kernels, allocator)
        t0 = time.perf_counter()
        spec = generate(target.model, EagleDrafter(head), ids, max_new_tokens, eos_token_ids=eos)
        spec_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        base = vanilla_generate(target.model, ids, max_new_tokens, eos_token_ids=eos)
        base_s = time.perf_counter() - t0
        rows.append({"check": f"{head.config.kind} head", "prompt": prompt_text[:30], "tau": round(spec.tau, 2),
                     "speedup": round((len(spec.tokens) / spec_s) / (len(base.tokens) / base_s), 2),
                     "identical": spec.tokens == base.tokens,
                     "first_divergence": first_divergence(spec.tokens, base.tokens)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--head-dir", default="outputs/demo/train/eagle3")
    ap.add_argument("--out", default="bench/results/gpu_check.json")
    args = ap.parse_args()
    target = load_target(TargetConfig(device=args.device, dtype=args.dtype))
    rows = lossless_rows(target, args.max_new_tokens)
    if (Path(args.head_dir) / "manifest.json").is_file():
        rows += head_rows(target, Path(args.head_dir), args.max_new_tokens)
    env = {"device": str(target.device), "dtype": str(target.dtype), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if target.device.type == "cuda" else platform.processor()}
    print(json.dumps(env))
    keys = ["check", "prompt", "tau", "speedup", "identical", "first_divergence"]
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
