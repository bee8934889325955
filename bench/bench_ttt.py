"""Efficient EAGLE-3 TTT vs the plain dense-mask reference (tests/test_ttt.py): one training step
(forward + backward, 7 rounds, batch 1) at SmolLM2 dimensions (H=576, 9 heads / 3 KV heads, head_dim 64,
intermediate 1536, target vocab 49152, draft vocab 32000), at 512 and 2048 tokens.

Each (variant, length) runs in a fresh child process so that the memory numbers are its own. On CPU,
tracemalloc does not see torch's allocations, so memory is the resident-set high-water mark (VmHWM in
/proc/self/status): reset to the current RSS (`5 > /proc/self/clear_refs`) right before the timed steps,
it gives the step's peak; `step_peak_mb` subtracts the RSS of the resident inputs and weights just before,
so the ratio compares what the step itself adds. (Without clear_refs, the child's ru_maxrss is used.)

The data are shaped like a chat dump: the first quarter of the tokens is prompt (loss mask 0), and the
target lm_head favours the draft vocabulary so the target top-1 falls inside it (`counted_fraction`; real
dumps come close, and any miss only helps the efficient path). The efficient path computes draft logits
only at counted positions (75% here); the reference, being plain, computes them everywhere. `attention_only`
isolates the attention kernels (all 7 rounds, forward + backward, at 2048) from the loss.

Usage: flock /tmp/eaglet-cpu.lock python -m bench.bench_ttt   (writes bench/results/ttt.json)
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

DIMS = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
            vocab_size=49152, draft_vocab_size=32000)
STEPS = 7
REPEATS = {512: 2, 2048: 1}  # timed steps after one warm-up step (keeps the whole run near 5 minutes)
VARIANTS = ("efficient", "dense")


def rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def build(seq_len: int):
    from pipeline.heads import build_draft_head
    from pipeline.heads.config import DraftHeadConfig

    torch.manual_seed(0)
    h, v, vd = DIMS["hidden_size"], DIMS["vocab_size"], DIMS["draft_vocab_size"]
    cfg = DraftHeadConfig(kind="eagle3", rms_norm_eps=1e-5, target_hidden_size=h, aux_layer_ids=[2, 15, 27], **DIMS)
    head = build_draft_head(cfg)
    with torch.no_grad():
        head.embed_tokens.weight.normal_(std=0.02)
    ids = torch.randperm(v)[:vd].sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    head.set_draft_vocab(ids - torch.arange(vd), t2d)
    lm_head_w = torch.randn(v, h) / math.sqrt(h)
    lm_head_w[~t2d] *= 0.5  # the target predicts draft-vocabulary tokens, as it mostly does on real data
    input_ids = torch.randint(0, v, (1, seq_len))
    loss_mask = torch.ones(1, seq_len, dtype=torch.long)
    loss_mask[:, : seq_len // 4] = 0
    aux = torch.randn(1, seq_len, 3 * h)
    final = torch.randn(1, seq_len, h) * 2.0
    valid = torch.ones(1, seq_len, dtype=torch.long)
    return head, (input_ids, loss_mask, aux, final, valid, lm_head_w)


def step_fn(variant: str, head, data):
    from pipeline.heads.losses import align_batch
    from pipeline.heads.ttt import eagle3_ttt_loss
    from tests.support.ttt import reference_ttt_loss

    input_ids, loss_mask, aux, final, valid, w = data
    if variant == "efficient":
        def step():
            out = eagle3_ttt_loss(head, align_batch(input_ids, loss_mask, aux, final, valid), w, ttt_steps=STEPS)
            out["loss"].backward()
            return out
    else:
        def step():
            loss = reference_ttt_loss(head, input_ids, loss_mask, aux, final, valid, w, STEPS)[0]
            loss.backward()
            return {"loss": loss}
    return step


def attention_step_fn(variant: str, seq_len: int):
    """All 7 rounds of round-0-causal + diagonal attention, forward + backward, nothing else."""
    from pipeline.heads.ttt import TTTAttention

    h, kv, d = DIMS["num_attention_heads"], DIMS["num_key_value_heads"], DIMS["head_dim"]
    torch.manual_seed(0)
    qs = [torch.randn(1, h, seq_len, d, requires_grad=True) for _ in range(STEPS)]
    ks = [torch.randn(1, kv, seq_len, d, requires_grad=True) for _ in range(STEPS)]
    vs = [torch.randn(1, kv, seq_len, d, requires_grad=True) for _ in range(STEPS)]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    eye = torch.eye(seq_len, dtype=torch.bool)

    def step():
        if variant == "efficient":
            attend = TTTAttention()
            outs = [attend(q, k, v) for q, k, v in zip(qs, ks, vs)]
        else:
            outs = []
            for i in range(STEPS):
                kk = torch.cat(ks[: i + 1], 2).repeat_interleave(h // kv, 1)
                vv = torch.cat(vs[: i + 1], 2).repeat_interleave(h // kv, 1)
                mask = torch.cat([causal] + [eye] * i, -1)
                s = (qs[i] @ kk.transpose(-1, -2) / math.sqrt(d)).masked_fill(~mask, float("-inf"))
                outs.append(s.softmax(-1) @ vv)
        sum(o.square().mean() for o in outs).backward()

    return step


def child(variant: str, seq_len: int, attention_only: bool) -> dict:
    torch.set_num_threads(int(os.environ.get("EAGLET_BENCH_THREADS", "2")))
    if attention_only:
        step, repeats = attention_step_fn(variant, seq_len), 1
    else:
        head, data = build(seq_len)
        step, repeats = step_fn(variant, head, data), REPEATS[seq_len]
    step()  # warm-up (allocator, lazy init)
    gc.collect()
    base = rss_mb()
    exact = reset_peak()
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - t0)
    peak = rss_mb("VmHWM")  # since the reset, or the whole process lifetime if it failed
    res = {"variant": variant, "seq_len": seq_len, "attention_only": attention_only, "repeats": repeats,
           "step_s": statistics.median(times), "step_times_s": times, "rss_before_mb": base,
           "peak_rss_mb": peak, "step_peak_mb": peak - base, "peak_reset": exact}
    if not attention_only:
        res["loss"] = float(out["loss"].detach())
        if "round_total" in out:
            res["counted_fraction"] = float(out["round_counted"][0] / out["round_total"][0])
    return res


def run_child(variant: str, seq_len: int, attention_only: bool) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_ttt", "--child", variant, str(seq_len)]
    cmd += ["--attention-only"] if attention_only else []
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"{variant}@{seq_len} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> dict:
    threads = int(os.environ.get("EAGLET_BENCH_THREADS", "2"))
    results = {"dims": DIMS, "ttt_steps": STEPS, "batch": 1, "threads": threads, "torch": torch.__version__,
               "runs": [], "ratios": {}}
    t_start = time.perf_counter()
    for attention_only, seq_lens in ((False, (512, 2048)), (True, (2048,))):
        for seq_len in seq_lens:
            pair = {}
            for variant in VARIANTS:
                r = run_child(variant, seq_len, attention_only)
                results["runs"].append(r)
                pair[variant] = r
                print(f"{'attention' if attention_only else 'train-step':>10} T={seq_len:5d} {variant:9s} "
                      f"{r['step_s']:7.2f} s  step peak {r['step_peak_mb']:8.0f} MB  "
                      f"(RSS peak {r['peak_rss_mb']:.0f} MB)", flush=True)
            eff, ref = pair["efficient"], pair["dense"]
            key = f"{'attention' if attention_only else 'step'}@{seq_len}"
            results["ratios"][key] = {"time": eff["step_s"] / ref["step_s"],
                                      "memory": eff["step_peak_mb"] / ref["step_peak_mb"],
                                      "rss_peak": eff["peak_rss_mb"] / ref["peak_rss_mb"]}
            if not attention_only:
                assert abs(eff["loss"] - ref["loss"]) <= 1e-3 * abs(ref["loss"]), (eff["loss"], ref["loss"])
    for key, r in results["ratios"].items():
        print(f"{key:>15}: efficient/dense time {r['time']:.2f}x  step memory {r['memory']:.2f}x  "
              f"RSS peak {r['rss_peak']:.2f}x")
    results["bench_wall_s"] = time.perf_counter() - t_start
    target = results["ratios"]["step@2048"]
    results["target_met"] = {"time<=0.6x": target["time"] <= 0.6, "memory<=0.5x": target["memory"] <= 0.5}
    print("targets at 2048 (time <= 0.6x, memory <= 0.5x):", results["target_met"])
    out = REPO / "bench" / "results" / "ttt.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out.relative_to(REPO)}")
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "SEQ_LEN"))
    ap.add_argument("--attention-only", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.attention_only)))
    else:
        main()
