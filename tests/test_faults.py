"""The fault campaign (bench/faults.py) at reduced counts: on the tiny random Llama, the reference chain (regen,
dump, train, eval, export, each a real `python -m pipeline.run` process), then one SIGKILL at a seeded moment
in eval and in export, the rerun, and the comparison with the uninterrupted run (eval answers and tau, export
files, manifests). These two stages have no kill test of their own; regen, dump and train are killed by
test_regen.py, test_dump_kill.py and test_train_resume.py, and all five by the full campaign
(bench/results/faults.json). About 70 s on 2 cores: 9 processes, mostly startup."""
from __future__ import annotations

import json

import pytest

from bench import faults

pytestmark = [pytest.mark.slow, pytest.mark.chain]
KILLED = ("eval", "export")


def test_a_kill_in_eval_and_in_export_resumes_to_identical_artefacts(tiny_model_dir, tmp_path):
    out = tmp_path / "faults.json"
    rc = faults.main(["--tiny", "--target-dir", str(tiny_model_dir), "--kills", "1", "--stages", ",".join(KILLED),
                      "--work", str(tmp_path / "work"), "--out", str(out)])
    results = json.loads(out.read_text())
    assert tuple(results["stages"]) == KILLED
    differences = {stage: [d for t in s["trials"] for d in t["differences"]] for stage, s in results["stages"].items()}
    assert rc == 0, differences
    for stage, s in results["stages"].items():
        assert (s["kills"], s["resumed"], s["identical"]) == (1, 1, 1), (stage, s)
        assert s["trials"][0]["outcome"] in ("mid_write", "between_writes"), (stage, s["trials"][0])
    assert results["config"]["tiny"] and results["machine"]["cores"] >= 1
