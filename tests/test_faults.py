"""The fault campaign (bench/faults.py) at reduced counts: on the tiny random Llama, one SIGKILL per stage of
the chain (regen, dump, train, eval, export) at a seeded moment, the rerun, and the comparison with an
uninterrupted run (answers, shards, losses and head, eval answers and tau, export files, manifests).
About 75 s on 2 cores: 15 `python -m pipeline.run` processes (5 reference, 5 killed, 5 reruns), mostly startup."""
from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

def load_faults():
    spec = importlib.util.spec_from_file_location("bench_faults", REPO / "bench" / "faults.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_kill_per_stage_resumes_to_identical_artefacts(tiny_model_dir, tmp_path):
    faults = load_faults()
    out = tmp_path / "faults.json"
    rc = faults.main(["--tiny", "--target-dir", str(tiny_model_dir), "--kills", "1", "--work", str(tmp_path / "work"),
                      "--out", str(out)])
    results = json.loads(out.read_text())
    assert list(results["stages"]) == list(faults.STAGES)
    differences = {stage: [d for t in s["trials"] for d in t["differences"]] for stage, s in results["stages"].items()}
    assert rc == 0, differences
    for stage, s in results["stages"].items():
        assert (s["kills"], s["resumed"], s["identical"]) == (1, 1, 1), (stage, s)
        assert s["trials"][0]["outcome"] != "failed_before_write", (stage, s["trials"][0])
    assert results["config"]["tiny"] and results["machine"]["cores"] >= 1
