"""The whole chain through the real CLI on the tiny Llama: regen -> dump -> train -> eval, each stage
reading the previous stage's manifest; the eval's greedy output equals vanilla decoding."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.eval.table import table
from pipeline.manifest import load_manifest
from tests.support.paths import REPO

pytestmark = pytest.mark.chain
# The stages' threads: 2, or the xdist worker's share of the cores (tests/conftest.py).
THREADS = os.environ.get("OMP_NUM_THREADS", "2")


def run_cli(args: list[str], env_extra: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS=THREADS, WANDB_MODE="offline", HF_HUB_OFFLINE="1", **(env_extra or {}))
    out = subprocess.run([sys.executable, "-m", "pipeline.run", *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{args[0]} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


def tiny_args(root: Path, model_dir: Path) -> list[str]:
    return [f"output_root={root}", "experiment=demo", "name=e2e", "target=hf", f"target.path={model_dir}",
            "target.name=tiny", "regen.limit=6", "regen.max_new_tokens=24", "regen.batch_size=4",
            "head.draft_vocab_size=200", "train.epochs=3", "train.lr=3e-3", "train.warmup_steps=2",
            "train.micro_batch_tokens=512", "train.save_every=0", "train.eval_every=0", "train.tau_prompts=1",
            "train.tau_max_new_tokens=8", "train.val_fraction=0.2", "eval.max_new_tokens=32",
            "tree.depth=4", "tree.top_k=4", "tree.total_tokens=16"]


QUESTIONS = [
    {"question_id": 1, "category": "math", "turns": ["What is 12 times 7?"]},
    {"question_id": 2, "category": "chat", "turns": ["Say hello.", "Now say it twice."]},
    {"question_id": 3, "category": "chat", "turns": ["Write a poem about the sea."]}]


@pytest.fixture(scope="module")
def chain(tmp_path_factory, tiny_model_dir):
    """regen -> dump -> train -> eval through the CLI, once for this module: (root, CLI args)."""
    tmp_path = tmp_path_factory.mktemp("e2e")
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    args = tiny_args(tmp_path, tiny_model_dir) + [f"eval.questions={questions}"]
    for stage in ("regen", "dump", "train", "eval"):
        run_cli([f"stage={stage}", *args])
    return tmp_path, args


RUN = "questions-T0-m32-float32-tree4x4x16"  # the eval run folder of tiny_args (the suite's auto = float32)


def test_chain_regen_dump_train_eval(chain):
    tmp_path, _ = chain
    exp = tmp_path / "e2e"
    regen, dump = load_manifest(exp / "regen", "regen"), load_manifest(exp / "dump", "dump")
    train = load_manifest(exp / "train" / "eagle3", "train")
    ev_dir = exp / "eval" / "eagle3" / RUN
    ev = load_manifest(ev_dir, "eval")
    # Each stage pins the exact manifest of its input.
    assert dump["inputs"][0]["path"].endswith("e2e/regen")
    assert train["inputs"][0]["path"].endswith("e2e/dump")
    assert ev["inputs"][0]["path"].endswith("e2e/train/eagle3")
    fp = regen["target"]
    assert dump["target"] == fp and train["target"] == fp and ev["target"] == fp
    assert regen["generation"]["precision"] == dump["precision"] == train["precision"] == ev["precision"] == "float32"

    summary = json.loads((ev_dir / "summary.json").read_text())
    assert summary["turns"] == 4  # the second question has two turns
    assert 1.0 <= summary["tau"] <= summary["settings"]["depth"] + 1
    assert summary["greedy_matches_baseline"] == "4/4"
    assert set(summary["time_fraction"]) == {"target", "draft", "other"}
    assert (ev_dir / "tau.png").stat().st_size > 0
    answers = [json.loads(line) for line in (ev_dir / "answers.jsonl").read_text().splitlines()]
    assert [(a["question_id"], a["turn"]) for a in answers] == [("1", 0), ("2", 0), ("2", 1), ("3", 0)]
    # The second turn is asked with the first turn's generated answer as history.
    assert answers[2]["prompt_tokens"] > answers[1]["prompt_tokens"] + answers[1]["new_tokens"]
    for a in answers:  # the prefill token plus exactly what each verification forward emitted
        assert a["new_tokens"] == 1 + sum(x + 1 for x in a["accept_lengths"])


def _answers(path: Path) -> list[tuple]:
    """What a resumed eval must reproduce exactly: everything but the timings."""
    return [(a["question_id"], a["turn"], a["answer"], a["accept_lengths"])
            for a in map(json.loads, path.read_text().splitlines())]


def test_eval_resumes_in_pieces_and_refuses_other_settings(chain):
    """A time budget stops after the question that crosses it (partial summary, no manifest); reruns continue
    from answers.partial.jsonl and end with the same answers as the uninterrupted eval; changed settings are
    refused instead of mixing two runs. The baseline covers only the first `baseline_limit` questions."""
    tmp_path, args = chain
    ev = tmp_path / "e2e" / "eval" / "eagle3"
    piece = [*args, "stage=eval", "eval.run_name=pieces", "eval.time_budget_s=0", "eval.baseline_limit=1"]
    for done in (1, 2):
        out = run_cli(piece)
        assert f"PARTIAL: {done} of 3 questions" in out.stdout
        partial = json.loads((ev / "pieces" / "summary.partial.json").read_text())
        assert (partial["questions_done"], partial["complete"]) == (done, False)
        assert not (ev / "pieces" / "manifest.json").exists()
        assert f"| eagle3 | pieces | 0 | float32 | {done}/3 (partial) | " in table(tmp_path / "e2e")
    bad = subprocess.run([sys.executable, "-m", "pipeline.run", *piece, "tree.top_k=2"], cwd=REPO,
                         env=dict(os.environ, OMP_NUM_THREADS=THREADS, WANDB_MODE="offline"), capture_output=True,
                         text=True, timeout=600)
    assert bad.returncode != 0 and "partial eval of another run" in bad.stderr + bad.stdout
    run_cli(piece)  # the last question
    summary = json.loads((ev / "pieces" / "summary.json").read_text())
    assert summary["complete"] and summary["turns"] == 4
    assert len(summary["acceptance_by_depth"]) == 4 + 1  # tree.depth=4: paths of up to 5 drafts
    assert summary["baseline_turns"] == 1 and summary["greedy_matches_baseline"] == "1/1"
    assert load_manifest(ev / "pieces", "eval")["counts"]["turns"] == 4
    assert not (ev / "pieces" / "summary.partial.json").exists()
    assert _answers(ev / "pieces" / "answers.jsonl") == _answers(ev / RUN / "answers.jsonl")
    rows = table(tmp_path / "e2e").splitlines()[2:]
    assert [r.split(" | ")[1:5] for r in rows] == [["pieces", "0", "float32", "3/3"],
                                                   ["questions", "0", "float32", "3/3"]]


def test_a_head_trained_on_an_fp32_dump_evaluates_with_a_bf16_target(chain):
    """The target's identity does not depend on its compute precision: the bf16 eval accepts the head
    trained on the fp32 dump, names its precision in the run folder and manifest, times vanilla decoding
    in both precisions (speedup against the faster) and reports how many greedy turns left bf16 vanilla."""
    tmp_path, args = chain
    run_cli([*args, "stage=eval", "target.dtype=bfloat16", "eval.baseline_limit=1"])
    ev_dir = tmp_path / "e2e" / "eval" / "eagle3" / "questions-T0-m32-bfloat16-tree4x4x16"
    manifest = load_manifest(ev_dir, "eval")
    assert manifest["precision"] == "bfloat16"
    assert manifest["target"] == load_manifest(tmp_path / "e2e" / "dump", "dump")["target"]
    summary = json.loads((ev_dir / "summary.json").read_text())
    rates = summary["baseline_tokens_per_s_by_precision"]
    assert set(rates) == {"bfloat16", "float32"} and summary["baseline_precision"] == max(rates, key=rates.get)
    assert summary["baseline_tokens_per_s"] == rates[summary["baseline_precision"]]
    assert 0 <= summary["greedy_divergent_share"] <= 1 and summary["turns"] == 4
    # Every turn is checked (eval.greedy_check: the first 10 questions), not only the baseline's (1 question).
    check = summary["greedy_check"]
    assert check["precision"] == "bfloat16" and check["turns"] == 4
