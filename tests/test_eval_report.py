"""Eval reporting: the summary's tau and acceptance by depth, and the head comparison of pipeline.eval.table
(tau of two heads on the turns both answered, from the resumable answers files the eval stage writes)."""
from __future__ import annotations

import json
import math

import pytest

from pipeline.decoding.decoder import GenerationResult
from pipeline.eval import table
from pipeline.eval.evaluate import TurnRecord
from pipeline.eval.progress import PARTIAL, EvalProgress
from pipeline.eval.report import summarize
from pipeline.eval.results_store import kept_runs, save
from pipeline.eval.table import comparison, scaling


def _record(qid: str, turn: int, lengths: list[int]) -> TurnRecord:
    return TurnRecord(question_id=qid, category="c", turn=turn, prompt_tokens=5, new_tokens=sum(a + 1 for a in lengths),
                      target_forwards=len(lengths), accept_lengths=lengths, wall_s=1.0, target_s=0.5, draft_s=0.4,
                      other_s=0.1, answer="")


def test_summary_counts_every_draft_level():
    # depth 2 trees hold paths of up to 3 drafts; lengths per forward: 3, 0, 2, 1 (+ 1 bonus token each)
    s = summarize([_record("1", 0, [3, 0]), _record("2", 0, [2, 1])], settings={}, max_draft_len=3)
    assert s["tau"] == pytest.approx(10 / 4)
    assert s["acceptance_by_depth"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert s["new_tokens"] == 10 and s["verification_forwards"] == 4


def test_one_generation_and_a_set_of_turns_count_acceptance_alike():
    one = GenerationResult(tokens=[], accept_lengths=[0, 1, 3])
    assert one.tau == pytest.approx(7 / 3) and one.acceptance_by_depth() == pytest.approx([2 / 3, 1 / 2, 1.0])
    levels = summarize([_record("1", 0, [0, 1, 3])], settings={}, max_draft_len=5)["acceptance_by_depth"]
    assert levels[:4] == pytest.approx([2 / 3, 1 / 2, 1.0, 0.0]) and math.isnan(levels[4])  # none reached 4
    empty = GenerationResult(tokens=[])
    assert math.isnan(empty.tau) and empty.acceptance_by_depth() == []


def _write(run_dir, per_question: dict[str, list[list[int]]]) -> None:
    progress = EvalProgress(run_dir, identity={"run": run_dir.name})
    for qid, turns in per_question.items():
        progress.append(qid, [_record(qid, t, lengths) for t, lengths in enumerate(turns)])


def test_heads_are_compared_on_the_turns_both_answered(tmp_path):
    exp = tmp_path / "exp"
    run = "mt_bench-T0-m256-float32-tree10x6x60"
    _write(exp / "eval/eagle3" / run, {"1": [[3, 1], [0]], "2": [[2, 2]], "3": [[5, 5, 5]]})
    _write(exp / "eval/eagle1" / run, {"1": [[1, 1], [1]], "2": [[0, 0]]})  # partial: no question 3
    _write(exp / "eval/eagle3/gsm8k-n20-T0", {"1": [[1]]})  # no eagle1 run: no row
    rows = comparison(exp).splitlines()
    assert len(rows) == 3
    # eagle3 on the shared 3 turns: (4 + 2 + 1 + 3 + 3) / 5 forwards; eagle1: (2 + 2 + 2 + 1 + 1) / 5
    cells = [c.strip() for c in rows[2].strip("|").split("|")]
    assert cells[:5] == ["mt_bench", "0", "6, 10, 60", "float32", "3"]
    ratio, interval = cells[7].split(" ", 1)
    assert [float(c.strip("*")) for c in (*cells[5:7], ratio)] == pytest.approx([2.6, 1.6, 2.6 / 1.6], abs=5e-3)
    # The paired bootstrap resamples the 2 shared questions, each drawn alone a quarter of the time: question 1
    # (eagle3 4 accepted over 3 forwards, eagle1 3 over 3: 2.33 / 2) and question 2 (3 / 1) bound the interval.
    low, high = (float(x) for x in interval.strip("()").split(","))
    assert (low, high) == pytest.approx((7 / 6, 3.0), abs=5e-3)


def test_an_eval_run_in_another_precision_is_the_same_eval_for_the_store_and_the_comparison(tmp_path):
    """A campaign moves between CPUs whose `precision=auto` differs: EAGLE-3's evals kept in bf16 are not measured
    again on an fp32 machine, and EAGLE-1's fp32 runs there pair with them, the precision column naming both."""
    from pipeline.eval.results_store import kept_as, precision_of, without_precision

    bf16, fp32 = "mt_bench-T0-m256-bfloat16-tree10x6x60", "mt_bench-T0-m256-float32-tree10x6x60"
    assert precision_of(bf16) == "bfloat16" and precision_of("gsm8k-n20-T0") is None
    assert without_precision(bf16) == without_precision(fp32) == "mt_bench-T0-m256-*-tree10x6x60"
    assert without_precision("mt_bench-T0-m256-float32-tree10x6x60-tpl-x") != without_precision(fp32)
    exp = tmp_path / "results"
    _write(exp / "eval/eagle3" / bf16, {"1": [[3, 1], [0]], "2": [[2, 2]]})
    _summary(exp / "eval/eagle3" / bf16, 2.0)
    _write(exp / "eval/eagle3/mt_bench-n40-T0-m128-bfloat16-tree10x6x60", {"1": [[1]]})
    _summary(exp / "eval/eagle3/mt_bench-n40-T0-m128-bfloat16-tree10x6x60", 2.0)
    assert kept_as(exp, "eagle3", bf16) == bf16 and kept_as(exp, "eagle3", fp32) == bf16
    assert kept_as(exp, "eagle3", "mt_bench-T0-m128-float32-tree10x6x60") is None  # another token budget
    assert kept_as(exp, "eagle3", "mt_bench-T0-m256-float32-tree10x3x8") is None  # another tree
    assert kept_as(exp, "eagle1", fp32) is None
    _write(exp / "eval/eagle1" / fp32, {"1": [[1, 1], [1]], "2": [[0, 0]]})
    _summary(exp / "eval/eagle1" / fp32, 1.6)
    assert kept_as(exp, "eagle1", bf16) == fp32
    rows = comparison(exp).splitlines()
    assert len(rows) == 3  # the n40 run has no EAGLE-1 run in any precision
    cells = [c.strip() for c in rows[2].strip("|").split("|")]
    assert cells[:5] == ["mt_bench", "0", "6, 10, 60", "bfloat16 / float32", "3"]
    assert float(cells[7].split(" ")[0].strip("*")) == pytest.approx(2.6 / 1.6, abs=5e-3)
    assert table._tree_of("mt_bench-n40-T0-m128-float32-tree10xautoxauto") == "chosen"
    assert table._tree_of("gsm8k-n20-T0") == "-"


def test_a_torn_last_line_is_dropped_and_a_corrupt_middle_line_refused(tmp_path):
    run = tmp_path / "run"
    _write(run, {"1": [[1, 0]], "2": [[2]]})
    path = run / PARTIAL
    intact = path.read_text()
    path.write_text(intact + '{"question_id": "3", "tu')  # killed mid-write
    resumed = EvalProgress(run, identity={"run": "run"})
    assert sorted(resumed.done) == ["1", "2"] and resumed.done["2"][0].accept_lengths == [2]
    assert path.read_text() == intact  # the next append starts on a clean line
    lines = intact.splitlines()
    path.write_text("\n".join([lines[0], lines[1][:10], lines[2]]) + "\n")
    with pytest.raises(ValueError, match=r"answers.partial.jsonl:2: corrupt line in the middle"):
        EvalProgress(run, identity={"run": "run"})
    path.write_text(intact)
    with pytest.raises(ValueError, match="partial eval of another run"):
        EvalProgress(run, identity={"run": "other settings"})


def _summary(run_dir, tau: float, chosen=None, done=40) -> None:
    """A summary.json as eval writes it: tree (6, 10, 60), or with `chosen` (depth, top_k, total) the tree eval
    chose (tree.depth/total_tokens=-1)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = {"depth": -1 if chosen else 6, "top_k": 10, "total_tokens": -1 if chosen else 60, "temperature": 0}
    summary = {"tau": tau, "settings": settings, "questions": 40, "questions_done": done}
    if chosen:
        summary["tree_choice"] = dict(zip(("depth", "top_k", "total_tokens"), chosen))
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_the_scaling_table_pairs_heads_by_data_fraction_and_tree(tmp_path):
    exp, run = tmp_path / "exp", "mt_bench-n40-T0-m128-bfloat16-tree10x6x60"
    for kind, taus in {"eagle3": (1.5, 1.7, 1.9, 2.0), "eagle1": (1.4, 1.5, 1.6, 1.6)}.items():
        for fraction, tau in zip(("-f0.125", "-f0.25", "-f0.5", ""), taus):
            _summary(exp / "eval" / f"{kind}{fraction}" / run, tau)
    _summary(exp / "eval/eagle3/mt_bench-n40-T0-m128-bfloat16-tree10x-1x-1", 2.2, chosen=(3, 10, 16))  # this CPU's
    _summary(exp / "eval/eagle3-f0.5/mt_bench-n80-T0-m256-bfloat16-tree10x6x60", 9.0)  # another run: not a point
    _summary(exp / "eval/abl-ttt5/mt_bench-n40-T0-m128-bfloat16-tree10x6x60", 9.0)  # an ablation: not a point
    for head, selected in {"eagle3": {"step": 400, "tau": 2.1, "last_step": 600}, "eagle1": None,
                           "eagle3-f0.125": {"step": 150, "tau": 1.6, "last_step": 150}}.items():
        (exp / "train" / head).mkdir(parents=True)  # train.select=tau: final/ is the best probe's step
        (exp / "train" / head / "manifest.json").write_text(json.dumps({"selected": selected}))
    plot = tmp_path / "scaling.png"
    rows = scaling(exp, "mt_bench-n40-T0-m128", plot=plot).splitlines()[2:]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    assert [(c[0], c[1]) for c in cells] == [("0.125", "6, 10, 60"), ("0.25", "6, 10, 60"), ("0.5", "6, 10, 60"),
                                              ("1", "6, 10, 60"), ("1", "chosen")]
    assert cells[0][2:] == ["40/40", "1.50", "1.40", f"**{1.5 / 1.4:.2f}**", "last / -"]
    assert cells[1][6] == "- / -"  # no train manifests
    assert cells[3][3:] == ["2.00", "1.60", "**1.25**", "400 of 600 / last"]
    assert cells[4][3:6] == ["2.20 (3, 10, 16)", "-", "-"]  # no EAGLE-1 run with a chosen tree
    assert plot.stat().st_size > 1000
    _write(exp / "eval/eagle3-f0.125" / run, {str(q): [[1, 1], [2]] for q in range(6)})  # per-turn records:
    _write(exp / "eval/eagle1-f0.125" / run, {str(q): [[1, 0], [q % 2]] for q in range(6)})  # the ratio's CI
    first = [c.strip() for c in scaling(exp, "mt_bench-n40-T0-m128").splitlines()[2].strip("|").split("|")]
    low, high = (float(x) for x in first[5].split("(")[1].rstrip(")").split(","))
    assert first[5].startswith(f"**{1.5 / 1.4:.2f}** (") and 1 < low < high
    _summary(exp / "eval/eagle1/mt_bench-n40-T0-m128-float32-tree10x6x60", 1.7)  # the same point in fp32
    with pytest.raises(ValueError, match="eval/eagle1: two runs named mt_bench-n40-T0-m128"):
        scaling(exp, "mt_bench-n40-T0-m128")
    assert len(scaling(exp, "mt_bench-n40-T0-m128-bfloat16").splitlines()) == 7  # a longer prefix tells them apart


def test_a_row_names_the_tree_eval_chose_not_its_minus_ones():
    """The quality table's tree column: the tree a run decoded with, also where eval chose it for this device
    (tree.depth/total_tokens=-1 in the settings, the choice in tree_choice)."""
    base = {"tau": 1.9, "questions": 40, "questions_done": 40, "turns": 80, "acceptance_by_depth": [0.65, 0.39],
            "spec_tokens_per_s": 31.4}
    chosen = {**base, "settings": {"depth": -1, "top_k": 10, "total_tokens": -1, "temperature": 0},
              "tree_choice": {"depth": 1, "top_k": 10, "total_tokens": 12}}
    fixed = {**base, "settings": {"depth": 6, "top_k": 10, "total_tokens": 60, "temperature": 0}}
    assert table.row("eagle3", "mt_bench-n40-T0-m128", chosen).endswith("| 31.4 | chosen: 1, 10, 12 |")
    assert table.row("eagle3", "mt_bench-n40-T0-m128", fixed).endswith("| 31.4 | 6, 10, 60 |")


def test_a_results_store_keeps_complete_runs_and_the_tables_read_it_alone(tmp_path):
    exp, store = tmp_path / "exp", tmp_path / "results"
    run = "mt_bench-n40-T0-m128-bfloat16-tree10x6x60"
    answered = {"eagle3": {"1": [[3, 1], [0]], "2": [[2, 2]]}, "eagle1": {"1": [[1, 1], [1]], "2": [[0, 0]]}}
    for head, turns in answered.items():
        _write(exp / "eval" / head / run, turns)
        _summary(exp / "eval" / head / run, 2.0)
    _summary(exp / "eval/eagle3-f0.5" / run, 1.8, done=12)  # partial (12 of 40): eval names it so; not kept
    (exp / "eval/eagle3-f0.5" / run / "summary.json").rename(exp / "eval/eagle3-f0.5" / run / "summary.partial.json")
    (exp / "train/eagle3/final").mkdir(parents=True)
    (exp / "train/eagle3/manifest.json").write_text('{"counts": {"steps": 10}}')
    (exp / "train/eagle1").mkdir(parents=True)
    (exp / "train/eagle1/manifest.json").write_text('{"counts": {}}')  # no final/: still training, not kept
    written = save(exp, store)
    assert written == {"eval": [f"eval/eagle1/{run}", f"eval/eagle3/{run}"], "train": ["train/eagle3"]}
    assert save(exp, store) == {"eval": [], "train": []}  # saving again changes no byte
    assert (store / "eval/eagle3" / run / f"{PARTIAL}.gz").is_file() and not (store / "train/eagle1").exists()
    assert comparison(store) == comparison(exp) and len(comparison(store).splitlines()) == 3  # gzipped, read back
    assert kept_runs(store, "eagle3", "mt_bench-n40-T0-m128") == [run]
    assert kept_runs(store, "eagle3", "mt_bench-n40-T0-m128", tree="10x-1x-1") == []
    assert kept_runs(store, "eagle3", "mt_bench-n40-T0-m12") == []  # a prefix ends at a '-'
    assert kept_runs(store, "eagle3-f0.5", "mt_bench-n40-T0-m128") == []  # its run is partial
    # A fresh machine rebuilt eagle3's head from its complete carry (it trained nothing): the store keeps the run's
    # own train record; a store that has none takes the rebuilt one (it names the run it was carried from).
    kept = (store / "train/eagle3/manifest.json").read_bytes()
    rebuilt = {"counts": {"steps": 10}, "machine": "another CPU",
               "carries": [{"step": 10, "complete": True, "train_manifest_sha256": "abc", "carry": "c"}]}
    (exp / "train/eagle3/manifest.json").write_text(json.dumps(rebuilt))
    assert save(exp, store) == {"eval": [], "train": []}
    assert (store / "train/eagle3/manifest.json").read_bytes() == kept
    assert save(exp, tmp_path / "empty")["train"] == ["train/eagle3"]
    trained_on = {**rebuilt, "carries": [{**rebuilt["carries"][0], "step": 8}]}  # it trained steps 9-10 here
    (exp / "train/eagle3/manifest.json").write_text(json.dumps(trained_on))
    assert save(exp, store)["train"] == ["train/eagle3"]


def test_results_has_asks_for_the_run_the_same_overrides_name(tmp_path, capsys):
    """`pipeline.results has` composes the eval's config, so the job script's skip names the exact run folder."""
    from pipeline.answers import compose
    from pipeline.results import main

    overrides = ["stage=eval", "head=eagle3", "head.name=abl-base", "experiment=smollm2_quality_v2", "eval.limit=20",
                 "eval.max_new_tokens=128"]
    cfg = compose(overrides[1:])
    assert cfg.eval_subject == "abl-base" and cfg.eval_run_name.startswith("mt_bench-n20-T0-m128-")
    with pytest.raises(SystemExit) as e:
        main(["has", str(tmp_path), *overrides])
    assert e.value.code == 1 and "not kept" in capsys.readouterr().out
    # Kept by a machine of the other precision: the same eval, not measured again here.
    mine = "bfloat16" if "-bfloat16-" in cfg.eval_run_name else "float32"
    other = cfg.eval_run_name.replace(f"-{mine}-", "-float32-" if mine == "bfloat16" else "-bfloat16-")
    _summary(tmp_path / "eval/abl-base" / other, 1.7)
    with pytest.raises(SystemExit) as e:
        main(["has", str(tmp_path), *overrides])
    assert e.value.code == 0 and f"kept as {other}" in capsys.readouterr().out
    _summary(tmp_path / "eval/abl-base" / cfg.eval_run_name, 1.7)
    with pytest.raises(SystemExit) as e:
        main(["has", str(tmp_path), *overrides])
    assert e.value.code == 0 and capsys.readouterr().out.endswith(" kept\n")
    with pytest.raises(SystemExit) as e:  # another tree is another run
        main(["has", str(tmp_path), *overrides, "tree.depth=-1", "tree.total_tokens=-1"])
    assert e.value.code == 1


def test_the_ablation_table_gives_each_rows_recipe_data_and_tau_against_base(tmp_path):
    exp, run = tmp_path / "results", "mt_bench-n20-T0-m128-bfloat16-tree10x6x60"

    def ablation(name, tau, train=None, head=None, dump=None, built=16000, tokens=300_000):
        (exp / "train" / f"abl-{name}").mkdir(parents=True)
        config = {"train": {"schedule": "cosine", "min_lr_ratio": 0.0, **(train or {})},
                  "head": {"draft_vocab_size": 16000, "ttt_steps": 7, "lm_head_init": "random", **(head or {})},
                  "dump": {"input": "regen", **(dump or {})}}
        manifest = {"config": config, "counts": {"train_rows": 321, "train_tokens": tokens, "steps": 150,
                                                 "draft_vocab_size": built}, "final_metrics": {"val/acc_0": 0.3}}
        (exp / "train" / f"abl-{name}" / "manifest.json").write_text(json.dumps(manifest))
        if tau is not None:
            _summary(exp / "eval" / f"abl-{name}" / run, tau)

    ablation("base", 1.80)
    ablation("floor", 1.85, train={"min_lr_ratio": 0.1})
    ablation("vocab32k", 1.70, head={"draft_vocab_size": 32000}, built=21000)
    ablation("orig", 1.50, dump={"input": "data"}, tokens=260_000)
    ablation("ttt5", None, head={"ttt_steps": 5})  # trained, not yet evaluated
    _summary(exp / "eval/eagle3" / run, 9.0)  # not an ablation
    rows = [[c.strip() for c in r.strip("|").split("|")]
            for r in table.ablations(exp, "mt_bench-n20-T0-m128").splitlines()[2:]]
    assert [r[0] for r in rows] == ["base", "floor", "orig", "ttt5", "vocab32k"]
    by = {r[0]: r for r in rows}
    assert by["base"][1] == "cosine, TTT 7, vocab 16000, lm_head random, regenerated" and by["base"][7] == "+0.00"
    assert by["floor"][1].startswith("cosine to 0.1,") and by["floor"][6:] == ["1.85", "+0.05"]
    assert "vocab 32000 (21000 seen)" in by["vocab32k"][1] and by["vocab32k"][7] == "-0.10"
    assert by["orig"][1].endswith("dataset's") and by["orig"][3] == "260,000" and by["orig"][7] == "-0.30"
    assert by["ttt5"][6:] == ["-", "-"]
    # With per-turn records, the difference gets a paired bootstrap interval over questions.
    _write(exp / "eval/abl-base" / run, {str(q): [[1, 0, 2], [1]] for q in range(10)})
    _write(exp / "eval/abl-floor" / run, {str(q): [[2, 1, 2], [1 + q % 2]] for q in range(10)})
    rows = [[c.strip() for c in r.strip("|").split("|")]
            for r in table.ablations(exp, "mt_bench-n20-T0-m128").splitlines()[2:]]
    floor = next(r for r in rows if r[0] == "floor")[7]
    low, high = (float(x) for x in floor.split("(")[1].rstrip(")").split(","))
    assert floor.startswith("+0.05 (") and 0 < low <= high  # better on every question: the interval excludes 0
    assert next(r for r in rows if r[0] == "vocab32k")[7] == "-0.10"  # no records: no interval
    same = table.turn_records(exp / "eval/abl-base" / run)
    assert table.paired_tau_ci(same, same) == (0.0, 0.0) and table.paired_tau_ci(same, {}) is None
