"""Dump benchmark on the real target (SmolLM2-135M, CPU).

1. Speed: dump tokens/s over forward-only tokens/s, in the same process, over the same batches: the
   baseline is the same decoder-body forward (`forward_only`), writing nothing. Rounds alternate
   forward-only and dump so drift (thermal, other load) hits both. Target: >= 0.9.
2. Size: bytes per token on disk over the raw size (captured layers x hidden x dtype bytes + int32 id +
   uint8 mask). Target: within 2%.
3. Memory: a dump and one 4x larger (the same shards copied 4 times, so only the size differs), each
   iterated -- every state byte summed -- in its own child process. Peak anonymous memory (RssAnon; the
   mapped shard pages are file-backed and not counted there) of the larger within 10% of the smaller's.

    flock /tmp/eaglet-cpu.lock python bench/bench_dump.py            # ~2 minutes on 2 cores
Writes bench/results/dump.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_DATA = REPO.parent / "shared" / "data" / "alpaca_en_demo" / "alpaca_en_demo.json"


def rss_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def read_child(dump_dir: str) -> None:
    """Iterate a whole dump, touching every state byte; print peak RssAnon / RssFile as JSON."""
    import torch

    from pipeline.hidden_states.reader import DumpReader

    torch.set_num_threads(1)
    before = rss_kb("RssAnon")
    t0 = time.perf_counter()
    reader = DumpReader(dump_dir)
    peak_anon, peak_file, checksum = rss_kb("RssAnon"), rss_kb("RssFile"), 0.0
    for i, sample in enumerate(reader):
        checksum += float(sample.aux_hidden.float().sum()) + float(sample.final_hidden.float().sum())
        if i % 4 == 0:
            peak_anon, peak_file = max(peak_anon, rss_kb("RssAnon")), max(peak_file, rss_kb("RssFile"))
    seconds = time.perf_counter() - t0
    peak_anon, peak_file = max(peak_anon, rss_kb("RssAnon")), max(peak_file, rss_kb("RssFile"))
    nbytes = reader.manifest["totals"]["bytes"]
    print(json.dumps({"rows": len(reader), "tokens": reader.num_tokens, "bytes": nbytes,
                      "shards": len(reader.manifest["shards"]), "rss_anon_before_open_kb": before,
                      "peak_rss_anon_kb": peak_anon, "peak_rss_file_kb": peak_file, "seconds": seconds,
                      "read_gb_per_s": nbytes / seconds / 1e9, "checksum": checksum}))


def measure_read(dump_dir: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--read", str(dump_dir)], cwd=REPO, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def replicate(src: Path, dst: Path, times: int) -> None:
    """A dump `times` larger: the shards of `src` copied, the manifest listing every copy."""
    manifest = json.loads((src / "manifest.json").read_text())
    dst.mkdir(parents=True)
    entries = []
    for k in range(times):
        for e in manifest["shards"]:
            name = f"shard-{len(entries):05d}.arrow"
            shutil.copyfile(src / e["file"], dst / name)
            entries.append(dict(e, file=name))
    manifest["shards"] = entries
    for key in ("rows", "tokens", "bytes"):
        manifest["totals"][key] *= times
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=1))


def load_samples(tokenizer, data: Path, tokens: int, max_length: int):
    from pipeline.data.bad_records import BadRecordReport
    from pipeline.data.chat import tokenize_conversation
    from pipeline.data.config import SourceConfig
    from pipeline.data.readers import read_source
    from pipeline.hidden_states.plan import TokenizedSample

    samples, total = [], 0
    for conv in read_source(SourceConfig(path=str(data)), BadRecordReport()):
        tok = tokenize_conversation(tokenizer, conv["messages"], max_length)
        if tok is None or tok.n_assistant_tokens == 0:
            continue
        samples.append(TokenizedSample(conv["id"], tok.input_ids, tok.loss_mask))
        total += len(tok.input_ids)
        if total >= tokens:
            break
    return samples


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--read", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=10_000, help="tokens per timed pass")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "dump.json"))
    args = ap.parse_args()
    if args.read:
        return read_child(args.read)

    started = time.perf_counter()
    import torch

    from pipeline.hidden_states.config import DumpConfig
    from pipeline.hidden_states.dump import dump_hidden_states, forward_only, plan_dump
    from pipeline.target import TargetConfig, load_target

    torch.set_num_threads(args.threads)
    target = load_target(TargetConfig())
    samples = load_samples(target.tokenizer, Path(args.data), args.tokens, max_length=512)
    cfg = DumpConfig(batch_tokens=4096, max_batch_size=16, shard_bytes=32 << 20)
    layout, plan = plan_dump(target, samples, cfg)
    forward_only(target, samples, plan.batches[:1])  # warm-up: one full-size batch

    work = Path(tempfile.mkdtemp(prefix="eaglet-bench-dump-"))
    fwd, dump = [], []

    def run_forward_only():
        tokens, seconds = forward_only(target, samples, plan.batches)
        fwd.append(tokens / seconds)

    def run_dump(r):
        out = work / f"dump-{r}"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        summary = dump_hidden_states(target, samples, cfg, out, progress=False)
        dump.append(summary.tokens / (time.perf_counter() - t0))  # the whole call: plan, shards, manifest
        return out, summary

    try:
        for r in range(args.rounds):  # ABBA order: a linear drift in machine speed cancels out
            if r % 2 == 0:
                run_forward_only()
                out, summary = run_dump(r)
            else:
                out, summary = run_dump(r)
                run_forward_only()
            print(f"round {r}: forward-only {fwd[-1]:.0f} tok/s, dump {dump[-1]:.0f} tok/s", flush=True)
        ratio = (sum(dump) / len(dump)) / (sum(fwd) / len(fwd))

        replicate(out, work / "dump-x4", 4)
        small, large = measure_read(out), measure_read(work / "dump-x4")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    anon_ratio = large["peak_rss_anon_kb"] / small["peak_rss_anon_kb"]
    bytes_ratio = summary.bytes_per_token / summary.raw_bytes_per_token
    result = {
        "target": target.fingerprint["name"], "device": str(target.device), "dtype": str(layout.dtype),
        "threads": args.threads, "layer_ids": list(layout.layer_ids), "hidden_size": layout.hidden_size,
        "samples": len(samples), "tokens_per_pass": summary.tokens, "batches": len(plan.batches),
        "batch_tokens": cfg.batch_tokens, "padding_fraction": 1 - summary.tokens / sum(
            len(b) * len(samples[b[0]]) for b in plan.batches),
        "forward_only_tokens_per_s": fwd, "dump_tokens_per_s": dump, "dump_over_forward": ratio,
        "bytes_per_token": summary.bytes_per_token, "raw_bytes_per_token": summary.raw_bytes_per_token,
        "bytes_over_raw": bytes_ratio,
        "memory": {"small": small, "large_4x": large, "peak_anon_large_over_small": anon_ratio},
        "targets": {"dump_over_forward_min": 0.9, "bytes_over_raw_max": 1.02, "peak_anon_ratio_max": 1.10},
        "bench_seconds": time.perf_counter() - started,
        "pass": {"speed": ratio >= 0.9, "size": bytes_ratio <= 1.02, "memory": anon_ratio <= 1.10},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("dump_over_forward", "bytes_over_raw", "pass")}, indent=1))
    print(f"memory: peak RssAnon {small['peak_rss_anon_kb'] / 1024:.0f} MiB ({small['bytes'] / 2**20:.0f} MiB dump) vs "
          f"{large['peak_rss_anon_kb'] / 1024:.0f} MiB ({large['bytes'] / 2**20:.0f} MiB dump): x{anon_ratio:.3f}")


if __name__ == "__main__":
    main()
