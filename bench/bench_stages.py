"""Every stage at this machine's speed, variants side by side in one run: bf16 on AMX CPUs against fp32, the
regeneration engines against each other, one table of ratios.

regen: the real regen stage (`python -m pipeline.run stage=regen`, multi-turn, resumable shards, each engine
in its own process so that its peak RSS is its own) on the same conversations of the quality experiment,
greedy, once per engine of ENGINES below (each a registered regen backend, pipeline/regen/backends.py):
  - llama.cpp: the llama.cpp server on the target's own GGUF (Q4_1 kernels), started by regen itself;
  - vllm: vLLM's CPU build, a server regen starts itself (`make engine-vllm`);
  - openvino: OpenVINO GenAI's continuous batching, in process, the target converted once (fp32 weights);
  - ctranslate2: CTranslate2's batched generation, in process, the target converted once (fp32);
  - hf-fp32 / hf-bf16 / hf-bf16-static-compile: in-process batched HF generate.
Each row: the engine's version, tokens/s (generated answer tokens over generation time: the manifest's
`generation_s`; model load, conversion and server start excluded and reported as startup_s), peak RSS (the
stage process's plus its server's process tree) and agreement with HF fp32 greedy: the share of identical
first answers and their mean common prefix in characters (`--reference hf-fp32-first-turns`, the default,
answers just the first turns, which are exactly hf-fp32's). An engine that is not installed or fails gives
its exact error instead. Ratios are over `--baseline` (llama.cpp).

    python -m bench.bench_stages --conversations 32 --max-new-tokens 256 --stages regen \
        --engines llama.cpp,vllm,openvino,ctranslate2 --work /tmp/engines   # a rerun reuses finished engines
dump, train, eval: the real stages, fp32 against bf16 (`auto` on a CPU with fast bf16), on the regenerated
conversations of the regen bench (the llama.cpp run's, else hf-fp32's):
  - dump: tokens/s (shard time, model load excluded), over the same body forward writing nothing on the same
    batches (the cost of capturing and writing, target >= 0.9); bytes per token on disk, over the raw size
    (layers x hidden x dtype bytes + id + mask, target within 2%); and memory: reading a dump 4x larger (its
    shards copied) in a child process peaks within 10% of the RssAnon of reading the dump itself (shards are
    memory-mapped, so a dump's size must not become resident memory);
  - train: EAGLE-3, 7 TTT rounds, micro-batches of 4096 tokens (the quality experiment's), `--train-steps`
    optimizer steps on each precision's dump; tokens/s over the steps after the first two (warm-up);
  - eval: the fp32-trained head decoding `--eval-questions` MT-bench questions with an fp32 and a bf16 target:
    tree-decoding tokens/s and tau of each, and vanilla decoding in both precisions.
Writes bench/results/stages.json (or --out); each stage's key holds baseline, best and ratio.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pipeline.config import EagletConfig
from pipeline.data.config import DataConfig
from pipeline.precision import cpu_description
from pipeline.regen.config import LlamaCppConfig, RegenConfig
from pipeline.regen.llama_server import binary_path
from pipeline.regen.shards import regen_sources
from pipeline.target import TargetConfig

REPO = Path(__file__).resolve().parents[1]

SHARED = REPO.parent / "shared" / "data"
# The quality experiment's first source (multi-turn ShareGPT): its first N conversations are the workload.
WORKLOAD = SHARED / "sharegpt_sg92k_sample1000" / "sharegpt_1000.json"


# Each engine row: the regen backend (pipeline/regen/backends.py) and the overrides that make it this engine.
ENGINES: dict[str, tuple[str, list[str]]] = {
    "hf-fp32": ("hf", ["target.dtype=float32"]),
    # The agreement reference at a fraction of hf-fp32's cost: the same conversations cut after their first
    # user turn. Agreement compares first answers only, and these are generated in the same single padded
    # batch as hf-fp32's first wave, so they are the very answers hf-fp32 gives.
    "hf-fp32-first-turns": ("hf", ["target.dtype=float32"]),
    "hf-bf16": ("hf", ["target.dtype=bfloat16"]),
    "hf-bf16-static-compile": ("hf", ["target.dtype=bfloat16", "regen.hf.cache=static", "regen.hf.compile=true"]),
    "llama.cpp": ("llamacpp", ["target.dtype=float32"]),  # flash attention off (regen.llamacpp.flash_attn)
    # llama.cpp's own default, flash attention where the backend has it (the CPU included): what eaglet ran
    # before regen.llamacpp.flash_attn turned it off (`--engines llama.cpp,llama.cpp-fa` measures both).
    "llama.cpp-fa": ("llamacpp", ["target.dtype=float32", "regen.llamacpp.flash_attn=auto"]),
    "vllm": ("vllm", []),
    "openvino": ("openvino", []),
    "ctranslate2": ("ctranslate2", []),
}


def regen_once(work: Path, name: str, args, batch: int) -> dict:
    """One engine's real regen stage in its own process (`python -m pipeline.run stage=regen`), so its peak
    RSS is its own; a finished run in --work is reused, so a long bench resumes. An engine that is not
    installed, or whose run fails, gives its exact error instead of figures."""
    from pipeline.regen import backends

    backend, overrides = ENGINES[name]
    overrides = [f"regen.backend={backend}", *overrides]
    if backend == "llamacpp":
        overrides += [f"regen.llamacpp.binary={args.llama_server}", f"regen.llamacpp.slots={args.slots}",
                      f"regen.llamacpp.ctx_per_slot={args.ctx_per_slot}", f"regen.llamacpp.threads={args.threads}"]
    overrides += [o for o in args.engine_option if o.startswith(f"regen.{backend}.")]
    cfg = EagletConfig(name=name, output_root=str(work), regen=RegenConfig(backend=backend))
    source = first_turns(work) if name.endswith("-first-turns") else WORKLOAD
    module = backends.module(backend)
    row = {"backend": backend, "version": module.version(), "overrides": overrides}
    done = cfg.stage_dir("regen") / "manifest.json"
    if not done.is_file():
        reason = module.unavailable(dataclasses.replace(cfg, target=TargetConfig(device="cpu")))
        if reason is not None and backend != "hf":
            return {**row, "error": f"unavailable: {reason}"}
        command = [sys.executable, "-m", "pipeline.run", "stage=regen", f"name={name}", f"output_root={work}",
                   f"data.sources=[{{path: '{source}', format: sharegpt, limit: {args.conversations}}}]",
                   f"regen.batch_size={batch}", "regen.batches_per_shard=1",
                   f"regen.max_new_tokens={args.max_new_tokens}", "regen.progress=false", *overrides]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        log_path = work / f"{name}.log"
        with open(log_path, "w") as log:
            proc = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode != 0 or not done.is_file():
            lines = [x for x in log_path.read_text(errors="replace").splitlines() if x.strip()]
            error = next((x for x in reversed(lines) if "Error" in x or x.startswith("eaglet:")), lines[-1] if lines
                         else f"exit code {proc.returncode}")
            return {**row, "error": error.strip()[:500], "log": str(log_path)}
    manifest = json.loads(done.read_text())
    timings, generation = manifest["timings"], manifest.get("generation", {})
    gen_s = timings["generation_s"]
    tokens = manifest["counts"]["tokens_generated"]
    rss = [timings.get("peak_rss_mb"), timings.get("server_peak_rss_mb")]
    return {**row, "tokens": tokens, "generation_s": gen_s, "tokens_per_s": tokens / gen_s,
            "wall_s": timings["wall_s"], "startup_s": timings["wall_s"] - gen_s,
            "server_startup_s": (generation.get("server") or {}).get("startup_s"),
            "peak_rss_mb": sum(r for r in rss if r) or None, "turns": manifest["counts"].get("turns"),
            "precision": generation.get("precision"), "answers": answers(cfg.stage_dir("regen"))}


def first_turns(work: Path) -> Path:
    """The workload with every conversation cut after its first user turn (written under --work, never
    committed: the text is the data set's)."""
    out = work / "first_turns.json"
    if not out.is_file():
        records = json.loads(WORKLOAD.read_text())
        for record in records:
            turns = record.get("conversations") or []
            first = next((i for i, t in enumerate(turns) if t.get("from") in ("human", "user")), None)
            record["conversations"] = [t for t in turns[:first + 1] if t.get("from") in ("system", "human", "user")
                                       ] if first is not None else turns
        out.write_text(json.dumps(records))
    return out


def answers(regen_dir: Path) -> dict[str, list[str]]:
    from pipeline.data.bad_records import BadRecordReport
    from pipeline.data.readers import read_sources

    convs = read_sources(DataConfig(sources=regen_sources(regen_dir)), BadRecordReport())
    return {c["id"]: [m["content"] for m in c["messages"] if m["role"] == "assistant"] for c in convs}


def agreement(base: dict[str, list[str]], other: dict[str, list[str]]) -> dict:
    """Share of identical assistant turns (first turns, which share their prompt) and mean common prefix."""
    same, prefix, n = 0, 0, 0
    for cid, turns in base.items():
        if cid not in other or not turns or not other[cid]:
            continue
        a, b = turns[0], other[cid][0]
        n += 1
        same += a == b
        prefix += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"first_turns_compared": n, "identical_share": same / n if n else None,
            "mean_common_prefix_chars": prefix / n if n else None}


def bench_regen(args, work: Path) -> dict:
    """Each engine once on the workload; every row's first answers are compared with the reference's (HF fp32
    greedy), and tokens/s is taken over the baseline's (the llama.cpp server, regen's engine before these)."""
    rows = {}
    order = [e for e in ENGINES if e in args.engines and e != args.reference] + [args.reference]
    for name in order:
        # Servers take every conversation at once (they stream through the slots); hf generates padded batches.
        batch = args.hf_batch if ENGINES[name][0] == "hf" else args.conversations
        rows[name] = regen_once(work, name, args, batch)
        print(f"regen {name}: " + (rows[name].get("error") or f"{rows[name]['tokens_per_s']:.1f} tokens/s"),
              flush=True)
    ref = rows[args.reference]
    if "error" in ref:
        raise SystemExit(f"the {args.reference} reference failed: {ref['error']}")
    base = rows.get(args.baseline) if "error" not in rows.get(args.baseline, {"error": 1}) else ref
    base_name = args.baseline if base is not ref else args.reference
    for name, row in rows.items():
        if "error" in row:
            continue
        row[f"ratio_to_{base_name}"] = row["tokens_per_s"] / base["tokens_per_s"]
        if name != args.reference:
            agree = agreement(ref["answers"], row["answers"])
            row.update(identical=agree["identical_share"], mean_common_prefix=agree["mean_common_prefix_chars"],
                       first_turns_compared=agree["first_turns_compared"])
    for row in rows.values():
        row.pop("answers", None)
    measured = [n for n in rows if "error" not in rows[n] and not n.endswith("-first-turns")]
    best = max(measured, key=lambda n: rows[n]["tokens_per_s"])
    return {"workload": {"source": str(WORKLOAD.relative_to(REPO.parent)), "conversations": args.conversations,
                         "max_new_tokens": args.max_new_tokens, "temperature": 0},
            "machine": {"cpu": cpu_description(), "threads": args.threads},
            "reference": args.reference,
            "baseline": {"name": base_name, "tokens_per_s": base["tokens_per_s"]},
            "best": {"name": best, "tokens_per_s": rows[best]["tokens_per_s"]},
            "ratio": rows[best]["tokens_per_s"] / base["tokens_per_s"], "engines": rows}


def stage_cfg(work: Path, name: str, regen_dir: Path, precision: str, **sections) -> EagletConfig:
    """An experiment under `work` whose regen stage is `regen_dir` (linked), at `precision`."""
    from pipeline.config import EvalConfig
    from pipeline.heads import Eagle3HeadConfig
    from pipeline.hidden_states.config import DumpConfig
    from pipeline.train.config import TrainConfig

    link = work / name / "regen"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(regen_dir.resolve())
    return EagletConfig(name=name, output_root=str(work), target=TargetConfig(dtype=precision),
                        dump=sections.get("dump", DumpConfig()), train=sections.get("train", TrainConfig()),
                        head=sections.get("head", Eagle3HeadConfig()), eval=sections.get("eval", EvalConfig()))


def pair(name_fp32: str, fp32: float, name_bf16: str, bf16: float) -> dict:
    best = (name_bf16, bf16) if bf16 > fp32 else (name_fp32, fp32)
    return {"baseline": {"name": name_fp32, "tokens_per_s": fp32},
            "best": {"name": best[0], "tokens_per_s": best[1]}, "ratio": best[1] / fp32}


def bench_dump(work: Path, regen_dir: Path, conversations: int) -> tuple[dict, dict]:
    from pipeline.hidden_states import run as dump_run
    from pipeline.hidden_states.config import DumpConfig

    rows, cfgs = {}, {}
    for precision in ("float32", "bfloat16"):
        cfg = cfgs[precision] = stage_cfg(work, f"stages-{precision}", regen_dir, precision,
                                          dump=DumpConfig(limit=conversations))
        if not (cfg.stage_dir("dump") / "manifest.json").is_file():
            dump_run.main(cfg)
        m = json.loads((cfg.stage_dir("dump") / "manifest.json").read_text())
        forward = forward_only_rate(cfg)
        rows[precision] = {"tokens": m["counts"]["tokens"], "tokens_per_s": m["timings"]["tokens_per_s"],
                           "forward_only_tokens_per_s": forward,
                           "dump_over_forward": m["timings"]["tokens_per_s"] / forward,
                           "bytes_per_token": m["totals"]["bytes_per_token"],
                           "bytes_over_raw": m["totals"]["bytes_per_token"] / m["totals"]["raw_bytes_per_token"],
                           "storage": m["dtype"], "precision": m["precision"]}
    out = pair("float32", rows["float32"]["tokens_per_s"], "bfloat16", rows["bfloat16"]["tokens_per_s"])
    out.update(bytes_per_token={p: r["bytes_per_token"] for p, r in rows.items()},
               bytes_ratio=rows["bfloat16"]["bytes_per_token"] / rows["float32"]["bytes_per_token"], runs=rows,
               memory=read_memory(cfgs["bfloat16"].stage_dir("dump"), work / "dump-x4"),
               targets={"dump_over_forward_min": 0.9, "bytes_over_raw_max": 1.02, "peak_anon_ratio_max": 1.10})
    return out, cfgs


def forward_only_rate(cfg: EagletConfig) -> float:
    """tokens/s of the target's body forward over the dump's own batches, writing nothing."""
    from pipeline.data.bad_records import BadRecordReport
    from pipeline.hidden_states.dump import forward_only, plan_dump
    from pipeline.hidden_states.inputs import read_conversations, tokenize_all
    from pipeline.target import load_target

    target = load_target(cfg.target)
    conversations, _ = read_conversations(cfg, target.fingerprint, BadRecordReport())
    samples, _ = tokenize_all(conversations, target.tokenizer, cfg.data, cfg.dump.limit)
    _, plan = plan_dump(target, samples, cfg.dump)
    forward_only(target, samples, plan.batches[:1])  # warm-up: one full-size batch
    tokens, seconds = forward_only(target, samples, plan.batches)
    return tokens / seconds


def rss_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def read_child(dump_dir: str) -> None:
    """(Child process) iterate a whole dump touching every state byte; print peak RssAnon / RssFile."""
    from pipeline.hidden_states.reader import DumpReader

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    reader = DumpReader(dump_dir)
    peak_anon, peak_file, checksum = rss_kb("RssAnon"), rss_kb("RssFile"), 0.0
    for i, sample in enumerate(reader):
        checksum += float(sample.aux_hidden.float().sum()) + float(sample.final_hidden.float().sum())
        if i % 4 == 0:
            peak_anon, peak_file = max(peak_anon, rss_kb("RssAnon")), max(peak_file, rss_kb("RssFile"))
    peak_anon, peak_file = max(peak_anon, rss_kb("RssAnon")), max(peak_file, rss_kb("RssFile"))
    print(json.dumps({"tokens": reader.num_tokens, "bytes": reader.manifest.totals["bytes"],
                      "peak_rss_anon_kb": peak_anon, "peak_rss_file_kb": peak_file,
                      "seconds": time.perf_counter() - t0, "checksum": checksum}))


def read_memory(dump_dir: Path, larger: Path) -> dict:
    """Peak memory reading a dump and a copy 4x larger, each in its own child process."""
    def measure(path: Path) -> dict:
        out = subprocess.run([sys.executable, "-m", "bench.bench_stages", "--read", str(path)], cwd=REPO,
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    manifest = json.loads((dump_dir / "manifest.json").read_text())
    shutil.rmtree(larger, ignore_errors=True)
    larger.mkdir(parents=True)
    entries = []
    for _ in range(4):  # the same shards copied 4 times: only the size differs
        for e in manifest["shards"]:
            name = f"shard-{len(entries):05d}.arrow"
            shutil.copyfile(dump_dir / e["file"], larger / name)
            entries.append(dict(e, file=name))
    (larger / "manifest.json").write_text(json.dumps(dict(manifest, shards=entries, totals={
        k: v * 4 if k in ("rows", "tokens", "bytes") else v for k, v in manifest["totals"].items()})))
    try:
        small, large = measure(dump_dir), measure(larger)
    finally:
        shutil.rmtree(larger, ignore_errors=True)
    return {"dump": small, "dump_x4": large,
            "peak_anon_x4_over_dump": large["peak_rss_anon_kb"] / small["peak_rss_anon_kb"]}


def bench_train(cfgs: dict, steps: int) -> dict:
    from pipeline.heads import Eagle3HeadConfig
    from pipeline.train import run as train_run
    from pipeline.train.config import TrainConfig

    rows = {}
    for precision, cfg in cfgs.items():
        cfg.head = Eagle3HeadConfig(ttt_steps=7, draft_vocab_size=8000)
        cfg.train = TrainConfig(max_steps=steps, epochs=100, micro_batch_tokens=4096, warmup_steps=2, save_every=0,
                                eval_every=0, tau_prompts=0, plot=False, lr=1e-3, val_max_batches=2,
                                mixed_precision="bf16" if precision == "bfloat16" else "no")
        metrics = cfg.stage_dir("train") / "metrics.jsonl"
        if not (cfg.stage_dir("train") / "manifest.json").is_file():
            train_run.main(cfg)
        steps_done = [json.loads(line) for line in metrics.read_text().splitlines()]
        rates = [r["tokens_per_s"] for r in steps_done if "tokens_per_s" in r][2:]
        if not rates:
            raise RuntimeError(f"{metrics}: no step after the 2 warm-up steps; raise --train-steps")
        rows[precision] = {"steps_timed": len(rates), "tokens_per_s": sum(rates) / len(rates),
                           "precision": json.loads((cfg.stage_dir("train") / "manifest.json").read_text())["precision"]}
    out = pair("float32", rows["float32"]["tokens_per_s"], "bfloat16", rows["bfloat16"]["tokens_per_s"])
    out.update(settings={"head": "eagle3", "ttt_steps": 7, "micro_batch_tokens": 4096, "steps": steps}, runs=rows)
    return out


def bench_eval(cfgs: dict, questions: int, max_new_tokens: int) -> dict:
    from pipeline.config import EvalConfig
    from pipeline.eval import run as eval_run

    rows = {}
    head_cfg = cfgs["float32"]  # one head (trained on the fp32 dump), decoded with each precision's target
    for precision in ("float32", "bfloat16"):
        cfg = dataclasses.replace(head_cfg, target=TargetConfig(dtype=precision), eval=EvalConfig(
            questions=str(SHARED / "mt_bench" / "question.jsonl"), limit=questions, max_new_tokens=max_new_tokens))
        summary_path = cfg.stage_dir("eval") / "summary.json"
        if not summary_path.is_file():
            eval_run.main(cfg)
        s = json.loads(summary_path.read_text())
        rows[precision] = {"tau": s["tau"], "tokens_per_s": s["spec_tokens_per_s"],
                           "vanilla_tokens_per_s": s["baseline_tokens_per_s_by_precision"],
                           "speedup": s["speedup"], "greedy_matches_baseline": s.get("greedy_matches_baseline")}
    out = pair("float32", rows["float32"]["tokens_per_s"], "bfloat16", rows["bfloat16"]["tokens_per_s"])
    out.update(tau_difference=rows["bfloat16"]["tau"] - rows["float32"]["tau"],
               settings={"questions": questions, "max_new_tokens": max_new_tokens, "tree": "10x6x60"}, runs=rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--llama-server", default=str(binary_path(LlamaCppConfig(), TargetConfig())))
    ap.add_argument("--slots", type=int, default=32)  # 128 conversations: the longest chain bounds the run
    ap.add_argument("--ctx-per-slot", type=int, default=8192)  # the model's context: no conversation refused
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="llama.cpp,vllm,openvino,ctranslate2",
                    help=f"comma-separated, of {', '.join(ENGINES)}; the reference always runs")
    ap.add_argument("--reference", default="hf-fp32-first-turns", choices=["hf-fp32", "hf-fp32-first-turns"],
                    help="whose first answers the others are compared with (HF fp32 greedy either way)")
    ap.add_argument("--baseline", default="llama.cpp", help="the engine tokens/s ratios are taken over")
    ap.add_argument("--engine-option", action="append", default=[],
                    help="a regen.<backend>.<option>=<value> override for that engine's runs (repeatable)")
    ap.add_argument("--stages", default="regen,dump,train,eval")
    ap.add_argument("--dump-conversations", type=int, default=48)
    ap.add_argument("--train-steps", type=int, default=20)
    ap.add_argument("--eval-questions", type=int, default=5)
    ap.add_argument("--eval-max-new-tokens", type=int, default=64)
    ap.add_argument("--work", default=None, help="keep engine runs here; finished ones are reused on a rerun")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "stages.json"))
    ap.add_argument("--read", help=argparse.SUPPRESS)  # the memory measurement's child process
    args = ap.parse_args()
    if args.read:
        return read_child(args.read)
    torch.set_num_threads(args.threads)
    args.engines = set(args.engines.split(","))
    if unknown := args.engines - set(ENGINES):
        ap.error(f"--engines: unknown {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    stages = args.stages.split(",")
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.is_file() else {}  # stages not rerun keep their figures
    result["machine"] = {"cpu": cpu_description(), "cores": os.cpu_count(), "threads": args.threads,
                         "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="eaglet-bench-stages-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if "regen" in stages:
            result["regen"] = bench_regen(args, work)
        regen_dir = next((work / e / "regen" for e in ("llama.cpp", "openvino", "ctranslate2", "hf-fp32")
                          if (work / e / "regen" / "manifest.json").is_file()), None)
        if regen_dir is not None and "dump" in stages:
            result["dump"], cfgs = bench_dump(work, regen_dir, args.dump_conversations)
            if "train" in stages:
                result["train"] = bench_train(cfgs, args.train_steps)
            if "eval" in stages:
                result["eval"] = bench_eval(cfgs, args.eval_questions, args.eval_max_new_tokens)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: {f: v.get(f) for f in ("baseline", "best", "ratio")} for k, v in result.items()
                      if isinstance(v, dict) and "ratio" in v}, indent=1))

if __name__ == "__main__":
    main()
