"""Scale: what a target larger than one device costs the stages, measured side by side in one run.

1. Peak RSS of offline training and of export (both read only the target's parts: embedding, lm_head, final norm)
   against loading the full target in the trainer's precision, and against the same training with the full target
   loaded (its tau probe decodes with it), for SmolLM2-135M and for a tiny target padded with 1 GB of experts
   (tests/support/families.py `build_padded_moe`): `rss_ratio` = parts / full. Each figure is the process's own peak (a
   stage's manifest's timings.peak_rss_mb, Linux VmHWM).
2. Dump tokens/s with the target tensor-parallel over 2 ranks against 1 rank (torchrun, gloo), on the suite's tiny
   Llama-shaped target: a correctness vehicle on 2 CPU cores, not a speed claim.
3. The dump reader's open time for 1k, 10k and 100k shards (bench/scale_reader.py).

    python -m bench.bench_scale      # ~5 minutes on 2 cores; writes bench/results/scale.json
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
SHARED = REPO.parent / "shared" / "data"
DATA = ["dump.input=data", f"data.sources=[{{path:{SHARED / 'alpaca_en_demo' / 'alpaca_en_demo.json'},limit:16}}]",
        "data.max_length=128"]

# The full target in the trainer's precision, in a fresh process: its peak is what loading it costs.
FULL_LOAD = """
import sys
from pipeline.manifest import peak_rss_mb
from pipeline.target import TargetConfig, load_target
kw = dict(arg.split("=", 1) for arg in sys.argv[1:])
load_target(TargetConfig(dtype="float32", **kw))
print("PEAK_RSS_MB", peak_rss_mb())
"""


def run(*args: str, cwd: Path = REPO) -> None:
    done = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"})
    if done.returncode:
        raise RuntimeError(f"{' '.join(args[:4])} ...: exit {done.returncode}\n{done.stderr[-3000:]}")
    return done.stdout


def stage(root: Path, target: list[str], *overrides: str) -> None:
    run("-m", "pipeline.run", "name=scale", f"output_root={root}", "wandb.mode=disabled", *target, *overrides)


def rss_row(root: Path, label: str, target: list[str], target_kw: dict, weights_bytes: int) -> dict:
    """dump -> offline train -> export on `target`, and a full load of it; each process's own peak RSS."""
    stage(root, target, "stage=dump", *DATA)
    stage(root, target, "stage=train", "head.name=h", "train.epochs=1", "train.tau_prompts=0", "train.plot=false",
          "train.save_every=1000", "train.eval_every=1000")
    # The same training with the target loaded whole: the tau probe (rank 0) decodes with it, as every rank of the
    # offline trainer held it before the parts.
    stage(root, target, "stage=train", "head.name=with-target", "train.epochs=1", "train.tau_prompts=1",
          "train.tau_max_new_tokens=4", "train.plot=false", "train.save_every=1000", "train.eval_every=1000")
    stage(root, target, "stage=export", "head.name=h", "export.format=sglang")
    out = run("-c", FULL_LOAD, *(f"{k}={v}" for k, v in target_kw.items()))
    full = float(out.split("PEAK_RSS_MB")[-1].split()[0])
    peak = lambda *p: json.loads((root / "scale" / Path(*p) / "manifest.json").read_text())["timings"]["peak_rss_mb"]  # noqa: E731
    train, export, with_target = peak("train", "h"), peak("export", "h", "sglang"), peak("train", "with-target")
    row = {"target": label, "weights_fp32_mb": round(weights_bytes / 2**20, 1), "full_load_peak_rss_mb": full,
           "train_peak_rss_mb": train, "train_with_full_target_peak_rss_mb": with_target,
           "export_peak_rss_mb": export,
           "rss_ratio": {"train": round(train / full, 3), "export": round(export / full, 3),
                         "train_vs_train_with_full_target": round(train / with_target, 3)}}
    print(json.dumps(row), flush=True)
    return row


def rss_section(work: Path) -> list[dict]:
    from pipeline.hidden_states.sizing import target_parameters
    from pipeline.target import TargetConfig, load_target_parts
    from tests.support.families import build_padded_moe

    smol_bytes = target_parameters(load_target_parts(TargetConfig()).model.config) * 4
    rows = [rss_row(work / "smollm2", "SmolLM2-135M-Instruct", ["target=smollm2_135m"], {}, smol_bytes)]
    path, padded_bytes = build_padded_moe(work / "padded-target")
    target = ["target=hf", f"target.path={path}", "target.name=padded", f"target.hub_id={path}"]
    kw = {"path": str(path), "name": "padded", "hub_id": str(path), "gguf_package": "", "gguf_file": ""}
    rows.append(rss_row(work / "padded", "tiny Qwen3-MoE padded with 256 experts x 7 layers", target, kw,
                        padded_bytes))
    return rows


def tp_section(work: Path, rows: int) -> dict:
    """bench/bench_tp.py's dump at TP=2 against TP=1 (the synthetic Llama: 8 heads / 4 kv heads)."""
    out = work / "tp.json"
    run("-m", "bench.bench_tp", "--rows", str(rows), "--out", str(out))
    return json.loads(out.read_text())


def reader_section(work: Path, counts: list[int]) -> dict:
    """bench/scale_reader.py: the dump reader's open time for manifests of many small shards."""
    from bench.scale_reader import reader_open_times

    return reader_open_times(work, counts=tuple(counts))


def main() -> None:
    from pipeline.precision import cpu_description

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "scale.json"))
    ap.add_argument("--sections", default="rss,tp,reader")
    ap.add_argument("--tp-rows", type=int, default=100, help="conversations the TP dumps write")
    ap.add_argument("--shards", type=lambda v: [int(x) for x in v.split(",")], default=[1000, 10000, 100000])
    args = ap.parse_args()
    sections = args.sections.split(",")
    from pipeline.manifest import code_version

    result = {"machine": {"cpu": cpu_description(), "cores": os.cpu_count()}, "command": "python -m bench.bench_scale",
              "date": time.strftime("%Y-%m-%d"), "code_version": code_version()}
    with tempfile.TemporaryDirectory(prefix="eaglet-bench-scale-") as tmp:
        work = Path(tmp)
        for name, section in (("rss", lambda w: rss_section(w)), ("tp", lambda w: tp_section(w, args.tp_rows)),
                              ("reader", lambda w: reader_section(w, args.shards))):
            if name in sections:
                (work / name).mkdir()
                t0 = time.perf_counter()
                result[name] = section(work / name)
                print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
