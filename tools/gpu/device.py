"""The device side of the GPU kit: run on the lent machine by `bash tools/gpu/device.sh <call>` (see kit.py).

Each call is a list of phases. A phase is one command with its own time budget; its status, wall time and
figures go into $OUT/results.json as soon as it ends, so a call stopped at its limit still returns what
finished. Call 1 (no GGUF needed): the environment, the carried wheels, the CUDA lossless tests on tiny
models (exact tokens in fp32) and the bf16 tie check. Call 2 (same machine, still warm): the target rebuilt
from the GGUF parts, the demo chain on CUDA, then the GPU-scale quality run (regen, dump, train EAGLE-3, eval
on MT-bench at T=0 against vanilla, verification cost by tree size) and the head's export, split into files
that fit what comes back.

Campaign mode (`--campaign EXPERIMENT`, kit.py prepare --campaign): call 2 instead trains the experiment's final
heads on its regenerated answers, which CPU sessions made and call 2 carries (the regen stage's output, packed):
EAGLE-3 then EAGLE-1, online, with the experiment's own recipe, only the device differing. The complete train
runs (final/, manifest, metrics) go back split into parts; what does not fit call 2's return waits in the stash
for call 3. `python -m tools.gpu.kit unpack` puts them under outputs/<experiment>/train/, where the
experiment's evals (on CPU) find them.

`--profile dryrun` runs the same phases here on CPU against a tiny model with small budgets (kit.py
--dry-run); `--profile gpu` is the lent H200.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.gpu import kitfiles  # parts, wheels and limits shared with kit.py

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Profile:
    """Budgets (seconds) and sizes of one kind of run. `gpu` must fit the device calls (kit.py checks)."""

    device: str
    budgets: dict
    quality_limit: int | None  # conversations regenerated in the quality run (None: the whole set)
    regen_batch: int
    regen_tokens: int
    train_epochs: int
    eval_limit: int
    eval_tokens: int
    micro_batch_tokens: int
    demo_overrides: list = field(default_factory=list)
    # Campaign mode: overrides of every train run (none on the GPU: the experiment's recipe as the CPU runs it),
    # and whether the runs read the kit's quality prompts (the dry run's campaign trains on the kit's own regen).
    campaign_overrides: list = field(default_factory=list)
    campaign_kit_data: bool = False
    # What call 1's lossless phase runs under pytest: on the device, every tiny-model lossless test in CUDA; the
    # dry run checks the phase's plumbing (pytest, junit counts) on the drafters' tests, the suite runs the rest.
    lossless_tests: list = field(default_factory=lambda: ["tests/test_lossless.py", "-m", "not slow"])
    # The bf16 tie check's size (prompts, new tokens): the dry run checks its plumbing at a size that stays short on
    # a CPU without fast bf16 (tests/test_bf16_ties.py holds the criterion itself).
    ties: tuple = (6, 96)


PROFILES = {
    "gpu": Profile(
        device="cuda",
        budgets={"env": 20, "install": 20, "lossless_cuda": 90, "bf16_ties": 40,  # call 1: 170 s
                 "target": 45, "demo": 90, "regen": 85, "dump": 25, "train": 60, "eval": 55, "tree_cost": 15,
                 "export": 15,  # call 2: 410 s
                 # campaign: call 2 525 s (EAGLE-3 first: ~1,700 steps of 4,096 tokens and 9 tau probes)
                 "inputs": 10, "train_eagle3": 300, "train_eagle1": 130, "back": 20, "rest": 30},
        quality_limit=None, regen_batch=256, regen_tokens=384, train_epochs=4, eval_limit=80, eval_tokens=256,
        micro_batch_tokens=16384),
    # The dry run's budgets guard against a hang. Alone on a 2-core Zen 4 EPYC its phases take 2-11 s (dump 5,
    # tree_cost 4, export 4); make test runs it beside another worker, on CPUs that can be several times slower.
    "dryrun": Profile(
        device="cpu",
        budgets={"env": 20, "install": 20, "lossless_cuda": 90, "bf16_ties": 40,
                 "target": 45, "demo": 100, "regen": 60, "dump": 45, "train": 60, "eval": 40, "tree_cost": 30,
                 "export": 30, "inputs": 10, "train_eagle3": 60, "train_eagle1": 60, "back": 20, "rest": 20},
        quality_limit=24, regen_batch=8, regen_tokens=16, train_epochs=1, eval_limit=2, eval_tokens=16,
        micro_batch_tokens=1024,
        demo_overrides=["regen.max_new_tokens=16", "train.epochs=1", "eval.max_new_tokens=16", "eval.limit=2"],
        campaign_overrides=["train.epochs=1", "train.micro_batch_tokens=1024", "train.save_every=0",
                            "train.eval_every=0"],
        campaign_kit_data=True,
        lossless_tests=["tests/test_lossless.py::test_eagle_drafter_is_lossless"], ties=(2, 32)),
}
CALL_PHASES = {1: ["env", "install", "lossless_cuda", "bf16_ties"],
               2: ["install", "target", "demo", "regen", "dump", "train", "eval", "tree_cost", "export"]}
# Campaign call 1 only installs and stashes its GGUF part: the lease's time goes to training in call 2.
CAMPAIGN_PHASES = {1: ["env", "install"], 2: ["install", "target", "inputs", "train_eagle3", "train_eagle1", "back"],
                   3: ["rest"]}
CAMPAIGN = "campaign"  # call 2's carried folder for the campaign: regen.tar.gz (kit.py campaign_pack)
STOP_GRACE_S = 20  # a train run stopped at its phase's budget writes its checkpoint in this


def phases(call: int, campaign: bool) -> list[str]:
    if call == 0:  # a stash call (kit.py adds them where the working tree is large): its GGUF part, nothing else
        return []
    return (CAMPAIGN_PHASES if campaign else CALL_PHASES)[call]


class Run:
    """Runs phases in order and rewrites results.json after each one."""

    def __init__(self, call: int, profile: Profile, out: Path, stash: Path, carried: Path, target: str | None,
                 campaign: str | None = None):
        self.call, self.profile, self.out, self.stash, self.carried = call, profile, out, stash, carried
        self.target, self.campaign = target, campaign
        self.results = {"call": call, "device": profile.device, "phases": {}}
        self.log = open(out / f"call{call}.log", "a")
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
                        TOKENIZERS_PARALLELISM="false", EAGLET_CACHE=str(stash / "cache"),
                        PYTHONPATH=os.pathsep.join([str(stash / "site"), str(REPO), os.environ.get("PYTHONPATH", "")]))
        self.outputs = stash / "outputs"

    def save(self) -> None:
        kitfiles.atomic_json(self.out / f"results{self.call}.json", self.results)

    def sh(self, args: list[str], budget: float, **kw) -> subprocess.CompletedProcess:
        self.log.write(f"$ {' '.join(args)}\n")
        self.log.flush()
        return subprocess.run(args, cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                              timeout=budget, check=True, **kw)

    def pipeline(self, stage: str, experiment: str, overrides: list[str], budget: float, outputs: Path | None = None,
                 stoppable: bool = False):
        args = [sys.executable, "-m", "pipeline.run", f"stage={stage}", f"experiment={experiment}",
                f"output_root={outputs or self.outputs}", f"target.device={self.profile.device}",
                *self.target_overrides(), *overrides]
        return self.sh_stoppable(args, budget) if stoppable else self.sh(args, budget)

    def sh_stoppable(self, args: list[str], budget: float) -> None:
        """`sh`, but at the budget a stop request (SIGTERM: train writes a checkpoint) STOP_GRACE_S before the
        kill; raises TimeoutExpired then, as `sh` does."""
        self.log.write(f"$ {' '.join(args)}\n")
        self.log.flush()
        proc = subprocess.Popen(args, cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=max(1.0, budget - STOP_GRACE_S))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise subprocess.TimeoutExpired(args, budget) from None
        if code:
            raise subprocess.CalledProcessError(code, args)

    def target_overrides(self) -> list[str]:
        return [f"target.path={self.target}"] if self.target else []

    def phase(self, name: str) -> None:
        budget = self.profile.budgets[name]
        t0 = time.monotonic()
        record = {"budget_s": budget}
        try:
            record.update(getattr(self, f"do_{name}")(budget) or {})
            record["status"] = "ok"
        except subprocess.TimeoutExpired:
            record["status"] = "timeout"
        except Exception as e:  # a phase failure is recorded and the call goes on where it can
            record.update(status="failed", error=f"{type(e).__name__}: {e}"[:2000])
        record["wall_s"] = round(time.monotonic() - t0, 1)
        self.results["phases"][name] = record
        self.log.write(f"--- {name}: {record['status']} in {record['wall_s']} s\n")
        self.log.flush()
        self.save()

    # -- call 1 ------------------------------------------------------------------------------------------

    def do_env(self, budget):
        code = ("import json, torch, transformers; print(json.dumps({'torch': torch.__version__, 'transformers': "
                "transformers.__version__, 'cuda': torch.cuda.is_available(), 'gpu': torch.cuda.get_device_name() "
                "if torch.cuda.is_available() else None, 'python': __import__('sys').version.split()[0]}))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=budget, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def do_install(self, budget):
        """The carried wheels into the stash (never a registry); the device's own torch/transformers stay."""
        wheels = sorted((self.carried / "wheels").glob("*.whl"))
        self.sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                 "--no-cache-dir", "--upgrade", "--target", str(self.stash / "site"), *map(str, wheels)], budget)
        self.sh([sys.executable, "-c", "import hydra, omegaconf, gguf, pipeline.run"], budget)
        return {"wheels": [w.name for w in wheels]}

    def do_lossless_cuda(self, budget):
        self.env["EAGLET_TEST_DEVICE"] = self.profile.device
        junit = self.stash / "lossless.xml"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *self.profile.lossless_tests, f"--junitxml={junit}"], cwd=REPO, env=self.env,
                              stdout=self.log, stderr=subprocess.STDOUT, timeout=budget)
        summary = kitfiles.junit_counts(junit)
        if proc.returncode != 0:
            raise RuntimeError(f"pytest exit {proc.returncode}: {summary}")
        return summary

    def do_bf16_ties(self, budget):
        out = self.stash / "ties.json"
        prompts, new_tokens = self.profile.ties
        self.sh([sys.executable, "-m", "tools.gpu.checks", "--device", self.profile.device, "--prompts", str(prompts),
                 "--new-tokens", str(new_tokens), "--out", str(out)], budget)
        return json.loads(out.read_text())

    # -- call 2 ------------------------------------------------------------------------------------------

    def do_target(self, budget):
        """The GGUF from its parts (one carried by each call; the earlier calls' kept in the stash), checked."""
        if self.target:  # dry run: a tiny local model stands in for the target; the parts are still checked
            path = kitfiles.join_parts(self.stash / "parts", self.carried / "parts", self.stash / "joined")
            return {"target": "tiny (dry run)", "gguf_bytes": path.stat().st_size}
        path = kitfiles.join_parts(self.stash / "parts", self.carried / "parts", self.stash / "target")
        self.target = str(path)
        self.sh([sys.executable, "-c", "import sys; from pipeline.target import TargetConfig, load_target; "
                 f"load_target(TargetConfig(path=sys.argv[1], device='{self.profile.device}'))", str(path)], budget)
        return {"gguf_bytes": path.stat().st_size}

    def do_demo(self, budget):
        t0 = time.monotonic()
        self.pipeline("all", "demo", ["export.format=sglang", *self.profile.demo_overrides], budget)
        summary = kitfiles.first_json(self.outputs / "demo" / "eval", "summary.json")
        return {"seconds": round(time.monotonic() - t0, 1), "eval": kitfiles.pick_summary(summary)}

    def quality(self, stage: str, budget: float, extra: list[str]):
        p = self.profile
        data = str(self.carried / "data" / "quality.jsonl.gz")
        source = f"{{path: '{data}', limit: {p.quality_limit}}}" if p.quality_limit else f"{{path: '{data}'}}"
        overrides = [f"data.sources=[{source}]", f"regen.batch_size={p.regen_batch}",
                     f"regen.max_new_tokens={p.regen_tokens}", f"train.epochs={p.train_epochs}",
                     f"train.micro_batch_tokens={p.micro_batch_tokens}",
                     f"eval.questions={self.carried / 'data' / 'mt_bench.jsonl'}", f"eval.limit={p.eval_limit}",
                     f"eval.max_new_tokens={p.eval_tokens}", *extra]
        return self.pipeline(stage, "gpu_kit", overrides, budget)

    def do_regen(self, budget):
        """Regenerate under a budget; what finished becomes the dump's input (finalize_partial)."""
        try:
            self.quality("regen", budget - 15, [])
        except subprocess.TimeoutExpired:
            self.quality("regen", 15, ["regen.finalize_partial=true"])
        return kitfiles.counts(self.outputs / "gpu_kit" / "regen" / "manifest.json")

    def do_dump(self, budget):
        self.quality("dump", budget, [])
        return kitfiles.counts(self.outputs / "gpu_kit" / "dump" / "manifest.json")

    def do_train(self, budget):
        self.quality("train", budget, [])
        return kitfiles.train_figures(self.outputs / "gpu_kit" / "train" / "eagle3")

    def do_eval(self, budget):
        self.quality("eval", budget, [f"eval.time_budget_s={max(5, budget - 25)}", "eval.baseline_limit=10"])
        summary = kitfiles.first_json(self.outputs / "gpu_kit" / "eval", "summary*.json")
        return kitfiles.pick_summary(summary)

    def do_tree_cost(self, budget):
        out = self.stash / "tree_cost.json"
        self.sh([sys.executable, "-m", "tools.gpu.checks", "--device", self.profile.device,
                 "--tree-cost", "--out", str(out), *(["--target", self.target] if self.target else [])], budget)
        return json.loads(out.read_text())

    def do_export(self, budget):
        self.quality("export", budget, ["export.format=sglang"])
        export = self.outputs / "gpu_kit" / "export" / "eagle3" / "sglang"
        return kitfiles.split_dir(export, self.out / "head", kitfiles.PART_BYTES)

    # -- campaign (call 2 and 3) ---------------------------------------------------------------------------

    @property
    def campaign_outputs(self) -> Path:
        return self.stash / "campaign_outputs"

    def do_inputs(self, budget):
        """The carried regen output (answers and prompts, as the CPU's regen stage wrote them) into place."""
        exp_dir = self.campaign_outputs / self.campaign
        shutil.rmtree(exp_dir / "regen", ignore_errors=True)
        exp_dir.mkdir(parents=True, exist_ok=True)
        top = kitfiles.extract_tar(self.carried / CAMPAIGN / "regen.tar.gz", exp_dir)
        if top != "regen":
            raise ValueError(f"{self.carried / CAMPAIGN / 'regen.tar.gz'} holds {top}/, not regen/")
        return kitfiles.counts(exp_dir / "regen" / "manifest.json")

    def campaign_train(self, kind: str, budget: float) -> dict:
        p = self.profile
        extra = list(p.campaign_overrides)
        if p.campaign_kit_data:  # the dry run: the regen it carries was made from the kit's prompts
            data = str(self.carried / "data" / "quality.jsonl.gz")
            extra.append(f"data.sources=[{{path: '{data}', limit: {p.quality_limit}}}]")
        try:
            overrides = [f"head={kind}", "train.source=online", "wandb.mode=disabled", *extra]
            self.pipeline("train", self.campaign, overrides, budget, outputs=self.campaign_outputs, stoppable=True)
        finally:
            train_dir = self.campaign_outputs / self.campaign / "train" / kind
            metrics = train_dir / "metrics.jsonl"
            if metrics.is_file():  # the throughput reached, also for a run stopped at its budget
                last = [json.loads(line) for line in metrics.read_text().splitlines() if '"tokens_per_s"' in line]
                self.results.setdefault("campaign", {})[kind] = last[-1] if last else {}
        return kitfiles.train_figures(train_dir)

    def do_train_eagle3(self, budget):
        return self.campaign_train("eagle3", budget)

    def do_train_eagle1(self, budget):
        return self.campaign_train("eagle1", budget)

    def do_back(self, budget):
        """Each complete train run (final/, manifest, metrics; never checkpoints) as parts of its own, EAGLE-3's
        first: what does not fit this call's return waits in the stash for call 3, and a run whose parts all came
        back is whole without the other's."""
        train = self.campaign_outputs / self.campaign / "train"
        back = self.stash / "back"
        shutil.rmtree(back, ignore_errors=True)
        runs = sorted((r for r in train.iterdir() if (r / "manifest.json").is_file() and (r / "final").is_dir())
                      if train.is_dir() else [], key=lambda r: (r.name != "eagle3", r.name))
        if not runs:
            raise RuntimeError(f"no complete train run under {train}")
        sent, record = {}, {}
        for run in runs:
            src = back / "src" / run.name / self.campaign / "train" / run.name  # unpack: <experiment>/train/<head>
            shutil.copytree(run / "final", src / "final")
            for name in ("manifest.json", "metrics.jsonl", "curves.png"):
                if (run / name).is_file():
                    shutil.copy2(run / name, src / name)
            split = kitfiles.split_dir(src.parents[1], back / "parts" / run.name, kitfiles.PART_BYTES)
            sent[run.name] = kitfiles.send_parts(back / "parts" / run.name, self.out, [], f"results{self.call}.json")
            record[run.name] = {**split, "sent": len(sent[run.name])}
        kitfiles.atomic_json(back / "sent.json", sent)
        return {"heads": record, "left_for_call_3": sum(r["parts"] - r["sent"] for r in record.values())}

    def do_rest(self, budget):
        back = self.stash / "back"
        if not (back / "sent.json").is_file():
            raise FileNotFoundError(f"{back}: nothing from call 2 (the machine went cold, or call 2 stopped early)")
        sent, left = json.loads((back / "sent.json").read_text()), {}
        for name, done in sent.items():
            parts = back / "parts" / name
            total = len(json.loads(next(parts.glob("*.index.json")).read_text())["parts"])
            now = kitfiles.send_parts(parts, self.out, done, f"results{self.call}.json") if len(done) < total else []
            if len(done) + len(now) < total:
                left[name] = total - len(done) - len(now)
        if left:
            raise RuntimeError(f"parts that still do not fit one return: {left}")
        return {"sent": {name: len(done) for name, done in sent.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("call", type=int, choices=(0, 1, 2, 3), help="0: a stash call (its --carried GGUF part only)")
    ap.add_argument("--campaign", default=None, metavar="EXPERIMENT",
                    help="call 2 trains this experiment's final heads on its carried regen output; call 3 sends "
                         "back what did not fit")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="gpu")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/eaglet-kit-out"))
    ap.add_argument("--stash", default=str(REPO / ".gpustash"))
    ap.add_argument("--carried", default=None, help="the call's carried folder (default .gpukit/call<N>)")
    ap.add_argument("--target", default=None, help="a local model instead of the GGUF (dry run)")
    args = ap.parse_args()
    out, stash = Path(args.out), Path(args.stash)
    out.mkdir(parents=True, exist_ok=True)
    stash.mkdir(parents=True, exist_ok=True)
    carried = Path(args.carried) if args.carried else REPO / ".gpukit" / f"call{args.call}"
    if args.call == 3 and not args.campaign:
        ap.error("call 3 is the campaign's (--campaign)")
    if args.call == 0 and not args.carried:
        ap.error("a stash call names its carried folder (--carried .gpukit/stashN)")
    run = Run(args.call, PROFILES[args.profile], out, stash, carried, args.target, args.campaign)
    if args.call in (0, 1):  # their GGUF parts wait in the stash for call 2, which carries the last one
        kitfiles.stash_parts(carried / "parts", stash / "parts")
        run.results["stashed"] = sorted(p.name for p in (carried / "parts").glob("*.part*"))
        run.save()
        if not run.results["stashed"]:  # said now, not in call 2's target phase after call 1's minutes
            sys.exit(f"call {args.call}: no GGUF part in {carried / 'parts'}; run `python -m tools.gpu.kit prepare` "
                     f"and the calls it prints, in order")
    for name in phases(args.call, bool(args.campaign)):
        run.phase(name)
    failed = [n for n, r in run.results["phases"].items() if r["status"] != "ok"]
    print(json.dumps(run.results, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
