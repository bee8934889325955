"""Every stage at this machine's speed, variants side by side in one run (issue: bf16 on AMX CPUs, a faster
regeneration engine, one table of ratios). This first part measures the regeneration engines.

regen: the real regen stage (`pipeline.regen.run.main`, multi-turn, resumable shards) on the same
conversations of the quality experiment, greedy, once per engine:
  - hf-fp32: in-process batched HF generate in float32 (today's default);
  - hf-bf16: the same with the target in bfloat16;
  - llama.cpp: the real llama.cpp `llama-server` (continuous batching over parallel slots) serving the same
    SmolLM2 GGUF through regen's `openai` backend, with as many concurrent requests as slots.
tokens/s is generated answer tokens over generation time (the manifest's `generation_s`: model load and
server start excluded, and reported). Answers of each engine are compared with hf-fp32's: the share of
identical answers and the mean common prefix (in characters), so users see what an engine trades.

    python bench/bench_stages.py --conversations 128 --max-new-tokens 256 \
        --llama-server .cache/llama.cpp/bin/llama-server          # make llama-server builds it
Writes bench/results/stages.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from pipeline.config import EagletConfig  # noqa: E402
from pipeline.data.config import DataConfig  # noqa: E402
from pipeline.regen import run as regen_run  # noqa: E402
from pipeline.regen.config import OpenAIBackendConfig, RegenConfig  # noqa: E402
from pipeline.regen.shards import regen_sources  # noqa: E402
from pipeline.target import TargetConfig, packaged_gguf  # noqa: E402

SHARED = REPO.parent / "shared" / "data"
# The quality experiment's first source (multi-turn ShareGPT): its first N conversations are the workload.
WORKLOAD = SHARED / "sharegpt_sg92k_sample1000" / "sharegpt_1000.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """The real llama.cpp server on 127.0.0.1 with `slots` parallel sequences sharing one KV cache."""

    def __init__(self, binary: str, gguf: Path, slots: int, ctx_per_slot: int, threads: int, log: Path):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log = open(log, "wb")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-np", str(slots),
             "-c", str(slots * ctx_per_slot), "-t", str(threads), "-tb", str(threads), "--no-webui"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.startup_s = self._wait()

    def _wait(self, deadline_s: float = 120) -> float:
        while time.perf_counter() - self.t0 < deadline_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.t0
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("llama-server did not become healthy")

    def props(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/props", timeout=10) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def regen_once(work: Path, name: str, conversations: int, max_new_tokens: int, batch: int,
               target: TargetConfig, openai: OpenAIBackendConfig | None = None) -> dict:
    cfg = EagletConfig(
        name=name, output_root=str(work), target=target,
        data=DataConfig(sources=[{"path": str(WORKLOAD), "format": "sharegpt", "limit": conversations}]),
        regen=RegenConfig(backend="openai" if openai else "hf", batch_size=batch, batches_per_shard=1,
                          max_new_tokens=max_new_tokens, progress=False, **({"openai": openai} if openai else {})))
    done = cfg.stage_dir("regen") / "manifest.json"
    t0 = time.perf_counter()
    if not done.is_file():  # a finished engine run in --work is reused, so a long bench resumes
        regen_run.main(cfg)
    wall = time.perf_counter() - t0
    manifest = json.loads(done.read_text())
    wall = max(wall, manifest["timings"]["wall_s"])
    gen_s = manifest["timings"]["generation_s"]
    tokens = manifest["counts"]["tokens_generated"]
    return {"tokens": tokens, "generation_s": gen_s, "tokens_per_s": tokens / gen_s, "wall_s": wall,
            "startup_s": wall - gen_s, "turns": manifest["counts"].get("turns"),
            "answers": answers(cfg.stage_dir("regen"))}


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
    """Each engine once, fastest first (a long bench interrupted keeps its finished engines in --work)."""
    rows = {}
    cfg32 = TargetConfig(dtype="float32")
    if args.llama_server and "llama.cpp" in args.engines:
        gguf = packaged_gguf(cfg32.gguf_package, cfg32.gguf_file)
        server = LlamaServer(args.llama_server, gguf, args.slots, args.ctx_per_slot, torch.get_num_threads(),
                             work / "llama-server.log")
        try:
            props = server.props().get("default_generation_settings", {})
            openai = OpenAIBackendConfig(base_url=server.base_url, concurrency=args.slots, timeout_s=1800)
            # One batch: conversations enter the server's slots as others finish (per-conversation schedule).
            row = regen_once(work, "llama.cpp", args.conversations, args.max_new_tokens, args.conversations, cfg32,
                             openai)
            # Requests ask temperature 0 (llama.cpp then samples greedily: argmax, no other sampler) and
            # top_p 1; of the server's defaults below only repeat_penalty applies (1.0: off).
            row.update(server_startup_s=server.startup_s, slots=args.slots, request_sampling={
                "temperature": 0.0, "top_p": 1.0}, server_defaults={k: props.get("params", props).get(k) for k in
                                                                   ("temperature", "repeat_penalty", "top_k", "top_p")})
            rows["llama.cpp"] = row
        finally:
            server.close()
    if "hf-bf16" in args.engines:
        rows["hf-bf16"] = regen_once(work, "hf-bf16", args.conversations, args.max_new_tokens, args.hf_batch,
                                     TargetConfig(dtype="bfloat16"))
    rows["hf-fp32"] = regen_once(work, "hf-fp32", args.conversations, args.max_new_tokens, args.hf_batch, cfg32)
    base = rows["hf-fp32"]
    for name, row in rows.items():
        row["ratio_to_hf_fp32"] = row["tokens_per_s"] / base["tokens_per_s"]
        if name != "hf-fp32":
            row["agreement_with_hf_fp32"] = agreement(base["answers"], row["answers"])
    for row in rows.values():
        row.pop("answers")
    best = max(rows, key=lambda n: rows[n]["tokens_per_s"])
    return {"workload": {"source": str(WORKLOAD.relative_to(REPO.parent)), "conversations": args.conversations,
                         "max_new_tokens": args.max_new_tokens, "temperature": 0},
            "baseline": {"name": "hf-fp32", "tokens_per_s": base["tokens_per_s"]},
            "best": {"name": best, "tokens_per_s": rows[best]["tokens_per_s"]},
            "ratio": rows[best]["tokens_per_s"] / base["tokens_per_s"], "engines": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--llama-server", default=str(REPO / ".cache" / "llama.cpp" / "bin" / "llama-server"))
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--ctx-per-slot", type=int, default=2560)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="hf-fp32,hf-bf16,llama.cpp",
                    help="comma-separated; hf-fp32, the baseline, always runs")
    ap.add_argument("--work", default=None, help="keep engine runs here; finished ones are reused on a rerun")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "stages.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.llama_server and not Path(args.llama_server).is_file():
        print(f"no llama-server at {args.llama_server} (make llama-server); measuring the hf engines only")
        args.llama_server = None
    args.engines = set(args.engines.split(","))
    with tempfile.TemporaryDirectory(prefix="eaglet-bench-stages-") as tmp:
        result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                              "threads": args.threads, "torch": torch.__version__},
                  "regen": bench_regen(args, Path(args.work or tmp))}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["regen"], indent=1))


if __name__ == "__main__":
    main()
