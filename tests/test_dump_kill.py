"""kill -9 at any moment, then rerun: the shards are byte-identical to an uninterrupted run's.

Each run is a child process with one thread (bit-reproducible forwards). Kills land at chosen points
(in the middle of a shard, between a shard's rename and its progress record) and at an arbitrary moment
from outside."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.dump_samples import make_samples
from tests.support.paths import REPO

CHILD = r"""
import json, os, signal, sys
import torch
torch.set_num_threads(1)
from pipeline.dist import RankInfo
from pipeline.hidden_states import shards
from pipeline.hidden_states.config import DumpConfig
from pipeline.hidden_states.dump import dump_hidden_states
from pipeline.hidden_states.plan import TokenizedSample
from pipeline.target import TargetConfig, load_target

model_dir, samples_file, out_dir, kill = sys.argv[1:5]
samples = [TokenizedSample(**s) for s in json.loads(open(samples_file).read())]
target = load_target(TargetConfig(name="tiny", path=model_dir, gguf_package=None))

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if kill.startswith("write:"):  # SIGKILL right after the n-th record batch reached a temporary shard
    n, write, calls = int(kill[6:]), shards.ShardWriter.write, [0]
    def write_then_die(self, batch):
        write(self, batch)
        calls[0] += 1
        if calls[0] == n:
            die()
    shards.ShardWriter.write = write_then_die
elif kill.startswith("renamed:"):  # SIGKILL after shard k is renamed, before its progress record
    k, close = int(kill[8:]), shards.ShardWriter.close
    def close_then_die(self):
        entry = close(self)
        if self.path.name == shards.shard_name(k):
            die()
        return entry
    shards.ShardWriter.close = close_then_die

print("started", flush=True)
cfg = DumpConfig(batch_tokens=128, max_batch_size=4, shard_bytes=300_000)
dump_hidden_states(target, samples, cfg, out_dir, rank=RankInfo(0, 1, 0), progress=False)
"""


def run_child(script: Path, model_dir, samples_file: Path, out: Path, kill: str = "none") -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(script), str(model_dir), str(samples_file), str(out), kill],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> int:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, -signal.SIGKILL), err[-3000:]
    return proc.returncode


def test_kill9_then_resume_is_byte_identical(tiny_tokenizer, tiny_model_dir, tmp_path):
    samples = make_samples(tiny_tokenizer, 64)
    samples_file = tmp_path / "samples.json"
    samples_file.write_text(json.dumps([s.__dict__ for s in samples]))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    ref, out = tmp_path / "reference", tmp_path / "killed"

    assert finish(run_child(script, tiny_model_dir, samples_file, ref)) == 0
    reference = {p.name: p.read_bytes() for p in sorted(ref.glob("shard-*.arrow"))}
    assert len(reference) >= 6

    # 1. mid-shard: a temporary file holds part of shard 1
    assert finish(run_child(script, tiny_model_dir, samples_file, out, kill="write:4")) == -signal.SIGKILL
    assert list(out.glob(".shard-*.arrow.tmp")) and not (out / "manifest.json").exists()
    # 2. between shard 3's rename and its record: the rerun must adopt it, not duplicate or lose it
    assert finish(run_child(script, tiny_model_dir, samples_file, out, kill="renamed:3")) == -signal.SIGKILL
    assert (out / "shard-00003.arrow").exists() and not (out / ".progress" / "shard-00003.arrow.json").exists()
    # 3. from outside, at whatever moment the next shard lands
    proc = run_child(script, tiny_model_dir, samples_file, out)
    deadline = time.monotonic() + 60
    while not (out / "shard-00004.arrow").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    finish(proc)

    assert finish(run_child(script, tiny_model_dir, samples_file, out)) == 0
    assert {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.arrow"))} == reference
    assert not list(out.rglob(".*.tmp"))
    manifest, ref_manifest = (json.loads((d / "manifest.json").read_text()) for d in (out, ref))
    assert manifest["shards"] == ref_manifest["shards"]
