"""The GPU kit (tools/gpu) works before the first lent GPU: `kit.py --dry-run` prepares the kit, checks
every limit of the device tool (bytes per call, files back and their sizes, phase budgets against the call
limits) and runs the device calls here on CPU against a tiny model, end to end, joining the returned head."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.paths import REPO
from tools.gpu import kitfiles
from tools.gpu.device import PROFILES


@pytest.mark.slow
@pytest.mark.kit
def test_gpu_kit_dry_run_passes(tmp_path):
    # A guard against a hang, not a speed check: the dry run runs the kit's checks on this machine's CPU, and a 2-core
    # Zen 3 EPYC (no fast bf16, ~8 GB/s of memory) took over 300 s.
    proc = subprocess.run([sys.executable, "-m", "tools.gpu.kit", "--dry-run", "--keep", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    plan = json.loads((REPO / ".gpukit" / "plan.json").read_text())
    assert all(call["bytes"] <= 64 << 20 for call in plan["calls"].values())
    assert plan["conversations"] > 1000  # the quality experiment's prompts travel
    r2 = json.loads((tmp_path / "out2" / "results2.json").read_text())
    assert {p: r["status"] for p, r in r2["phases"].items()} == dict.fromkeys(
        ["install", "target", "demo", "regen", "dump", "train", "eval", "tree_cost", "export"], "ok")
    assert r2["phases"]["export"]["parts"] >= 1
    r1 = json.loads((tmp_path / "out1" / "results1.json").read_text())
    # The dry run's lossless phase runs the drafters' tests only (the suite runs the file); the device runs it whole.
    lossless = r1["phases"]["lossless_cuda"]
    assert {k: lossless[k] for k in ("tests", "failures", "errors", "skipped")} == {
        "tests": 2, "failures": 0, "errors": 0, "skipped": 0}
    assert PROFILES["gpu"].lossless_tests == ["tests/test_lossless.py", "-m", "not slow"]
    assert r1["phases"]["bf16_ties"]["divergences_outside_tie_bound"] == 0
    # ... at the dry run's size (the device decodes 6 prompts of 96 tokens)
    assert r1["phases"]["bf16_ties"]["prompts"] == PROFILES["dryrun"].ties[0] and PROFILES["gpu"].ties == (6, 96)
    # Campaign mode on call 2's regen output: both heads trained online there, sent back, unpacked, and the
    # EAGLE-3 run evaluated on CPU from outputs/ as the experiment's own evals would.
    cplan = json.loads((tmp_path / "kit" / "plan.json").read_text())
    assert [c["command"] for c in cplan["calls"].values() if c["call"]] == [
        f"bash tools/gpu/device.sh {n} --campaign gpu_kit" for n in (1, 2, 3)]
    assert all(c["bytes"] <= 64 << 20 for c in cplan["calls"].values())
    assert sum(c["timeout_s"] for c in cplan["calls"].values()) <= 15 * 60 - 120
    r2c = json.loads((tmp_path / "out2c" / "results2.json").read_text())
    assert {p: r["status"] for p, r in r2c["phases"].items()} == dict.fromkeys(
        ["install", "target", "inputs", "train_eagle3", "train_eagle1", "back"], "ok")
    assert list(r2c["phases"]["back"]["heads"]) == ["eagle3", "eagle1"]  # each run in parts of its own, EAGLE-3 first
    assert r2c["phases"]["inputs"]["complete"] and set(r2c["campaign"]) == {"eagle1", "eagle3"}
    train = tmp_path / "cpu_outputs" / "gpu_kit" / "train"
    for kind in ("eagle1", "eagle3"):
        manifest = json.loads((train / kind / "manifest.json").read_text())
        assert manifest["source"] == "online" and (train / kind / "final" / "model.safetensors").is_file()
        assert not (train / kind / "checkpoints").exists()  # never optimizer states
    assert list((tmp_path / "cpu_outputs" / "gpu_kit" / "eval").rglob("summary*.json"))


def test_campaign_parts_that_do_not_fit_one_return_go_in_the_next(tmp_path, monkeypatch):
    src = tmp_path / "runs"
    (src / "train" / "eagle3").mkdir(parents=True)
    (src / "train" / "eagle3" / "weights.bin").write_bytes(bytes(range(256)) * 2000)  # 512,000 bytes
    parts = tmp_path / "stash" / "train"
    assert kitfiles.split_dir(src, parts, part_bytes=100_000)["parts"] == 6
    monkeypatch.setattr(kitfiles, "BACK_FILES", 6)
    monkeypatch.setattr(kitfiles, "BACK_TOTAL_BYTES", 2 * kitfiles.MiB)
    out2, out3 = tmp_path / "out2", tmp_path / "out3"
    out2.mkdir()
    (out2 / "call2.log").write_text("log")
    sent = kitfiles.send_parts(parts, out2, [], "results2.json")
    # 6 files: the log, the index and (room kept for) results2.json leave 3 parts.
    assert len(sent) == 3 and kitfiles.back_violations(out2) == []
    out3.mkdir()
    for i in range(4):  # a return with no room left: nothing goes, not even the index
        (out3 / f"f{i}.txt").write_text("x")
    assert kitfiles.send_parts(parts, out3, sent, "results3.json") == [] and not (out3 / "train").exists()
    for i in range(4):
        (out3 / f"f{i}.txt").unlink()
    rest = kitfiles.send_parts(parts, out3, sent, "results3.json")
    assert len(rest) == 3 and not set(rest) & set(sent)
    joined = kitfiles.join_dir([out2 / "train", out3 / "train"], tmp_path / "joined")
    assert (joined / "train" / "eagle3" / "weights.bin").read_bytes() == bytes(range(256)) * 2000


def test_parts_join_back_checked(tmp_path):
    src = tmp_path / "model.gguf"
    src.write_bytes(bytes(range(256)) * 1000)
    index = kitfiles.split_file(src, tmp_path / "a", part_bytes=100_000)
    assert len(index["parts"]) == 3
    (tmp_path / "b").mkdir()  # one part travels in another call's folder
    (tmp_path / "a" / index["parts"][2]).rename(tmp_path / "b" / index["parts"][2])
    joined = kitfiles.join_parts(tmp_path / "a", tmp_path / "b", tmp_path / "out")
    assert joined.read_bytes() == src.read_bytes()
    joined.unlink()
    part = tmp_path / "b" / index["parts"][2]
    part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(ValueError, match="sha256"):
        kitfiles.join_parts(tmp_path / "a", tmp_path / "b", tmp_path / "out")
    part.unlink()
    with pytest.raises(FileNotFoundError, match=r"model.gguf.part2.*run all the calls again"):
        kitfiles.join_parts(tmp_path / "a", tmp_path / "b", tmp_path / "out")


def test_a_large_working_tree_cuts_the_gguf_in_more_parts_carried_by_stash_calls(tmp_path):
    """Every call sends the working tree: committed heads or carries leave calls 1 and 2 too little room for
    GGUF halves, so the GGUF goes in more parts, the extra ones in stash calls (device.sh 0) that run first;
    every call fits, and the parts of all calls join back."""
    from tools.gpu.kit import max_stash_calls, place_gguf, write_plan

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(bytes(range(256)) * 6000)  # 1,536,000 B
    kit = tmp_path / "kit"
    (kit / "call1" / "wheels").mkdir(parents=True)
    (kit / "call1" / "wheels" / "w.whl").write_bytes(b"w" * 10_000)
    (kit / "call2" / "data").mkdir(parents=True)
    (kit / "call2" / "data" / "d.jsonl.gz").write_bytes(b"d" * 20_000)
    limit = 1 << 20
    assert place_gguf(kit, gguf, tree=50_000, limit=limit) == []  # a small tree: halves, as before
    assert len(list((kit / "call1" / "parts").glob("*.part*"))) == 1
    stash = place_gguf(kit, gguf, tree=400_000, limit=limit)
    assert stash == ["stash1"] and not (kit / "stash2").exists()
    plan = write_plan(kit, {"working_tree_bytes": 400_000, "stash_calls": stash})
    assert list(plan["calls"]) == ["stash1", "call1", "call2"]
    assert [c["call"] for c in plan["calls"].values()] == [0, 1, 2]
    assert plan["calls"]["stash1"]["command"] == f"bash tools/gpu/device.sh 0 --carried {kit / 'stash1'}"
    assert all(c["bytes"] <= limit for c in plan["calls"].values())
    joined = kitfiles.join_parts(*(kit / n / "parts" for n in plan["calls"]), tmp_path / "out")
    assert joined.read_bytes() == gguf.read_bytes()
    assert [p.name for p in (kit / "call2" / "parts").glob("*.part*")] == ["model.gguf.part2"]  # the last part
    with pytest.raises(ValueError, match="leave .* of the device's"):
        place_gguf(kit, gguf, tree=limit - 100_000, limit=limit)
    # 5 parts needed, time for 1 stash call
    with pytest.raises(ValueError, match="in the 3 parts the lease has time for"):
        place_gguf(kit, gguf, tree=600_000, limit=limit, max_stash=1)
    assert (max_stash_calls(False), max_stash_calls(True)) == (4, 2)  # 30 s each beside the calls' 640 s / 720 s


def test_a_stash_call_that_carries_no_part_fails_at_once(tmp_path):
    empty = tmp_path / "stash1"
    empty.mkdir()
    proc = subprocess.run([sys.executable, "-m", "tools.gpu.device", "0", "--carried", str(empty), "--profile",
                           "dryrun", "--out", str(tmp_path / "out"), "--stash", str(tmp_path / "stash")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "no GGUF part in" in proc.stderr
    assert json.loads((tmp_path / "out" / "results0.json").read_text())["stashed"] == []


def test_back_violations_name_every_limit(tmp_path):
    out = tmp_path / "out"
    (out / "a" / "b" / "c").mkdir(parents=True)
    assert kitfiles.back_violations(out) == []
    for i in range(8):
        (out / f"f{i}.json").write_text("{}")
    assert kitfiles.back_violations(out) == []
    (out / "a" / "b" / "c" / "deep.txt").write_text("x")
    (out / "a" / "big.bin").write_bytes(b"\0" * (16 * kitfiles.MiB + 1))
    (out / "a" / "odd name.txt").write_text("x")
    problems = "\n".join(kitfiles.back_violations(out))
    for expected in ("11 files back", "big.bin: 16777217 bytes", "deep.txt: more than 2 folders down",
                     "odd name.txt: a name with"):
        assert expected in problems


def test_wheel_from_installed_installs_offline(tmp_path):
    whl = kitfiles.wheel_from_installed("omegaconf", tmp_path / "wheels")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                    str(tmp_path / "site"), str(whl)], check=True, timeout=120)
    probe = "import omegaconf, sys; print(omegaconf.__version__, omegaconf.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], env={"PYTHONPATH": str(tmp_path / "site")},
                         capture_output=True, text=True, check=True).stdout
    from importlib.metadata import version

    assert out.split()[0] == version("omegaconf") and str(tmp_path / "site") in out
