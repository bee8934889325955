"""Every T=0 eval proves it decoded the target's own greedy output (pipeline/decoding/ties.py): the answers are
followed with the target's one-token forwards, a parting above the precision's tie bound fails the eval in one line,
ties are counted and reported, and tau is also given on the turns that stayed on the greedy path. Bugs are injected
into the verifier to show the check catches them; an exact tie is built into the target to show a tie passes."""
from __future__ import annotations

import pytest
import torch

import pipeline.decoding.decoder as decoder
from pipeline.decoding.decoder import follow_greedy, generate, vanilla_generate
from pipeline.decoding.ties import GreedyPathError, tie_bound, ulp
from pipeline.decoding.tree import TreeSpec
from pipeline.eval.config import EvalConfig
from pipeline.eval.evaluate import answer_questions, repeat_share
from pipeline.eval.questions import Question
from pipeline.eval.report import summarize
from pipeline.target import TargetConfig, load_target
from tests.support.oracle_drafter import OracleDrafter

TREE = TreeSpec(top_k=4, depth=3, total_tokens=12)
QUESTIONS = [Question("q1", "writing", ["Write a short poem about the sea.", "Make it shorter."]),
             Question("q2", "math", ["What is 12 times 7?"])]
SETTINGS = {"top_k": 4, "depth": 3, "total_tokens": 12, "temperature": 0.0, "device": "cpu"}


def tiny(tiny_model_dir, dtype: str):
    return load_target(TargetConfig(name="tiny", path=str(tiny_model_dir), gguf_package=None, dtype=dtype))


def missing_drafter(target, prompt):
    """Drafts along the greedy continuation but leaves the right token out: every emitted token is a bonus."""
    reference = list(prompt) + vanilla_generate(target.model, prompt, 64, eos_token_ids=()).tokens
    return OracleDrafter(reference, target.model.config.vocab_size, miss_rate=1.0)


class OnePerTurnDrafter:
    """What answer_questions drafts with: a fresh missing_drafter per prompt (it knows the prompt at `start`)."""

    feature_layers = ()

    def __init__(self, target):
        self.target, self.inner = target, None

    def start(self, input_ids, states, next_token):
        self.inner = missing_drafter(self.target, input_ids.tolist())
        self.inner.start(input_ids, states, next_token)

    def accept(self, states, next_tokens):
        self.inner.accept(states, next_tokens)

    def draft(self, spec, temperature=0.0, generator=None):
        return self.inner.draft(spec, temperature, generator)


REAL_VERIFY = decoder.verify_greedy


def runner_up_bonus(at_call: int):
    """A verifier bug: at its `at_call`-th call the bonus is the target's second-ranked token."""
    real, calls = REAL_VERIFY, {"n": 0}

    def verify(tree, logits):
        path, bonus = real(tree, logits)
        calls["n"] += 1
        if calls["n"] == at_call:
            bonus = int(torch.topk(logits[path[-1]].float(), 2).indices[1])
        return path, bonus

    return verify


def last_of_tied_bonus():
    """Another tie-break: among exactly tied first-ranked tokens, the bonus is the highest id (argmax takes the
    lowest). Not a bug: the emitted token is ranked first too."""
    real = REAL_VERIFY

    def verify(tree, logits):
        path, bonus = real(tree, logits)
        row = logits[path[-1]].float()
        return path, int((row == row.max()).nonzero().max())

    return verify


def cfg(**kw) -> EvalConfig:
    return EvalConfig(**{"max_new_tokens": 24, "baseline": False, "greedy_check": None, **kw})


# -- the check itself ------------------------------------------------------------------------------------------------


def test_following_greedy_output_finds_no_parting_and_an_altered_token_is_the_only_one(tiny_model_dir):
    target = tiny(tiny_model_dir, "float32")
    prompt = target.tokenizer("The quick brown fox").input_ids
    greedy = vanilla_generate(target.model, prompt, 20, eos_token_ids=()).tokens
    base, partings = follow_greedy(target.model, prompt, greedy)
    assert partings == [] and base.tokens == greedy and base.n_target_forwards == 19
    # Token 7 replaced by the runner-up, the rest greedy from there: one parting, at 7, exact in fp32 (bound 0).
    z = follow_logits(target.model, prompt, greedy[:7])
    other = int(torch.topk(z, 2).indices[1])
    tail = vanilla_generate(target.model, prompt + greedy[:7] + [other], 12, eos_token_ids=()).tokens
    _, partings = follow_greedy(target.model, prompt, greedy[:7] + [other] + tail)
    assert [(p.step, p.emitted, p.greedy, p.bound, p.tie) for p in partings] == [(7, other, greedy[7], 0.0, False)]
    # (z is a whole-sequence forward: another layout than the cached one-token steps, equal up to fp32 rounding)
    assert partings[0].margin == pytest.approx(float(z[greedy[7]] - z[other]), rel=1e-4)


def follow_logits(model, prompt, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt + tokens])).logits[0, -1].float()


def test_the_tie_bound_is_the_last_roundings_of_two_layouts():
    z = torch.tensor([10.0, 9.99, 3.0])
    h, w = torch.tensor([1.0, -2.0]), torch.tensor([[0.5, 0.25], [0.5, 0.25], [0.0, 1.0]])
    # bf16: one ulp of each logit (2^-4 at [8, 16)) and 2u |W_t| |h| for each (u = 2^-8, |W_t| |h| = 1).
    assert ulp(10.0, torch.bfloat16) == 2.0 ** -4 and ulp(0.75, torch.bfloat16) == 2.0 ** -8
    assert tie_bound(z, h, w, 0, 1, torch.bfloat16) == pytest.approx(2 * 2.0 ** -4 + 2 * 2 * 2.0 ** -8)
    assert tie_bound(z, None, None, 0, 1, torch.float16) == pytest.approx(2 * 2.0 ** -7)
    assert tie_bound(z, h, w, 0, 1, torch.float32) == 0.0  # fp32: exact


# -- in an eval ------------------------------------------------------------------------------------------------------


def test_an_fp32_eval_fails_at_a_verification_bug_naming_the_turn_and_step(tiny_model_dir, monkeypatch):
    target = tiny(tiny_model_dir, "float32")
    records = answer_questions(target, OnePerTurnDrafter(target), QUESTIONS, cfg(), TREE)
    assert [r.partings for r in records] == [[], [], []] and all(r.matches_baseline for r in records)
    summary = summarize(records, {**SETTINGS, "dtype": "float32"}, 4)
    assert summary["greedy_check"] == {"precision": "float32", "turns": 3, "on_greedy_path": 3,
                                       "tau_on_greedy_path": summary["tau"], "partings": 0, "ties": 0,
                                       "largest_margin": None, "largest_margin_bound": None}
    assert set(summary["tau_per_turn"]) == {"1", "2"}

    monkeypatch.setattr(decoder, "verify_greedy", runner_up_bonus(at_call=5))
    with pytest.raises(GreedyPathError) as e:
        answer_questions(target, OnePerTurnDrafter(target), QUESTIONS, cfg(), TREE)
    # Every token is a bonus (the drafter always misses): call 5 emits token 5 (the prefill emitted token 0).
    message = str(e.value)
    assert message.startswith("question q1 turn 1, step 5: the speculative decoder emitted token ")
    assert "above the float32 tie bound 0;" in message and "not the target's greedy output" in message
    assert "\n" not in message
    # eval.greedy_check=0: nothing fails. Without a baseline nothing is checked; with one, its forwards (the check)
    # record the parting, and the turn is not on the greedy path.
    monkeypatch.setattr(decoder, "verify_greedy", runner_up_bonus(at_call=5))
    unchecked = answer_questions(target, OnePerTurnDrafter(target), QUESTIONS, cfg(greedy_check=0), TREE)
    assert all(r.partings is None for r in unchecked)
    monkeypatch.setattr(decoder, "verify_greedy", runner_up_bonus(at_call=5))
    recorded = answer_questions(target, OnePerTurnDrafter(target), QUESTIONS, cfg(greedy_check=0, baseline=True), TREE)
    assert [len(r.partings) >= 1 for r in recorded] == [True, False, False] and recorded[0].partings[0]["step"] == 5
    assert recorded[0].baseline_new_tokens == recorded[0].new_tokens and not recorded[0].matches_baseline


def test_a_bf16_eval_counts_exact_ties_and_fails_a_parting_above_the_bound(tiny_model_dir, monkeypatch):
    from pipeline.data.chat import render_prompt

    target = tiny(tiny_model_dir, "bfloat16")
    prompt = Question("q1", "writing", ["Write a short poem about the sea."])
    # The target ranks two tokens exactly alike wherever it ranks the answer's 4th token first: that token's lm_head
    # row copied into an unused id's. The tie-break then emits the twin, which the target ranks first too.
    ids = render_prompt(target.tokenizer, [{"role": "user", "content": prompt.turns[0]}])
    answer = generate(target.model, OnePerTurnDrafter(target), torch.tensor(ids), 24, tree=TREE).tokens
    chosen, twin = answer[3], target.model.config.vocab_size - 1
    assert twin not in answer
    with torch.no_grad():
        target.model.get_output_embeddings().weight[twin] = target.model.get_output_embeddings().weight[chosen]
    monkeypatch.setattr(decoder, "verify_greedy", last_of_tied_bonus())
    records = answer_questions(target, OnePerTurnDrafter(target), [prompt], cfg(), TREE)
    partings = records[0].partings
    built = [p for p in partings if p["emitted"] == twin]
    # The first: where the answer first ranks `chosen` first after the prefill (whose argmax is no verifier's).
    assert built and built[0]["step"] == answer.index(chosen, 1) and all(p["greedy"] == chosen for p in built)
    assert all(p["margin"] == 0.0 and p["bound"] > 0 and p["verify_gap"] == 0.0 for p in built)
    assert all(p["tie"] for p in partings)  # bf16's own partings, if any, are ties too
    summary = summarize(records, {**SETTINGS, "dtype": "bfloat16"}, 4)
    g = summary["greedy_check"]
    assert (g["partings"], g["ties"], g["on_greedy_path"], g["turns"]) == (len(partings), len(partings), 0, 1)
    assert g["tau_on_greedy_path"] is None

    # A runner-up that is no tie (the target ranks it lower by more than the bound) fails a bf16 eval too.
    target = tiny(tiny_model_dir, "bfloat16")  # (no twin)
    monkeypatch.setattr(decoder, "verify_greedy", runner_up_bonus(at_call=2))
    with pytest.raises(GreedyPathError, match=r"question q1 turn 1, step 2: .* above the bfloat16 tie bound "):
        answer_questions(target, OnePerTurnDrafter(target), [prompt], cfg(), TREE)


def test_a_compared_drafter_parting_from_vanilla_above_the_bound_fails_the_comparison(tiny_model_dir, monkeypatch,
                                                                                       tmp_path):
    from pipeline.eval.compare import decode_turns
    from tests.support.config import compose_cfg

    target = tiny(tiny_model_dir, "float32")
    config = compose_cfg(["target=hf", f"target.path={tiny_model_dir}", "target.name=tiny", "eval.max_new_tokens=24"])
    variants = {"oracle": (OnePerTurnDrafter(target), {"top_k": 4, "depth": 3, "total_tokens": 12})}
    monkeypatch.setattr(decoder, "verify_greedy", runner_up_bonus(at_call=3))
    with pytest.raises(GreedyPathError, match=r"^question q1 turn 1, step 3: .* above the float32 tie bound 0;"):
        decode_turns(config, target, variants, QUESTIONS, tmp_path)


def test_a_looping_answer_is_flagged_and_tau_is_given_without_it():
    assert repeat_share(list(range(40))) == 0.0
    loop = [1, 2, 3, 4, 5] * 8  # the same 5 tokens again and again: every 4-gram after the first 5 repeats
    assert repeat_share(loop) == pytest.approx(32 / 37)
    from pipeline.eval.evaluate import TurnRecord

    def rec(qid, accepts, share):
        return TurnRecord(qid, "c", 0, 5, 10, len(accepts), accepts, 1.0, 1.0, 0.0, 0.0, "a", repeat_share=share)

    records = [rec("prose", [0, 1, 0, 1], 0.02), rec("loop", [4, 4, 4], 0.86)]
    summary = summarize(records, {**SETTINGS, "dtype": "float32"}, 5)
    assert summary["looping"] == {"threshold": 0.5, "turns": 1, "flagged": [["loop", 1]], "tau_without": 1.5}
    assert summary["tau"] == pytest.approx((1 + 2 + 1 + 2 + 5 + 5 + 5) / 7)


# -- the committed head, as shipped ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_committed_head_evaluates_from_its_export_folder(smollm2, tiny_model_dir, tmp_path):
    """eval.head_dir: the head in heads/ (an export's files and manifest, no training folder), held to its manifest
    (files, target fingerprint), decodes the target's greedy output in fp32 and drafts well above tau 1."""
    import json
    import shutil

    from pipeline.manifest import ManifestError
    from pipeline.run import run_stages
    from tests.support.config import compose_cfg
    from tests.support.paths import REPO

    shipped = REPO / "heads" / "smollm2-135m-instruct-eagle3"
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": [
        "Compose an engaging travel blog post about a recent trip to Hawaii.", "Rewrite it in one sentence."]}) + "\n")
    overrides = ["stage=eval", "experiment=smollm2_quality_v2", f"output_root={tmp_path / 'out'}",
                 "target.dtype=float32", f"eval.questions={questions}", "eval.max_new_tokens=48",
                 "eval.baseline=false", "wandb.mode=disabled"]
    run_stages(compose_cfg([*overrides, f"eval.head_dir={shipped}"]))
    (run,) = (tmp_path / "out" / "smollm2_quality_v2" / "eval" / shipped.name).iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["head"]["export"] == str(shipped) and summary["head"]["kind"] == "eagle3"
    assert summary["greedy_check"]["on_greedy_path"] == summary["greedy_check"]["turns"] == 2
    assert summary["tau"] > 1.3 and set(summary["tau_per_turn"]) == {"1", "2"}
    # A copy whose weights changed is refused before it decodes, naming the file.
    copy = tmp_path / "copy"
    shutil.copytree(shipped, copy)
    with (copy / "model.safetensors").open("r+b") as f:
        f.seek((copy / "model.safetensors").stat().st_size // 2)
        f.write(b"\x7f" * 8)
    with pytest.raises(ManifestError, match="model.safetensors"):
        run_stages(compose_cfg([*overrides, f"eval.head_dir={copy}"]))
    # ... and so is the head for another target than its manifest records.
    with pytest.raises(ManifestError, match="exported head's target config digest mismatch"):
        run_stages(compose_cfg([*overrides, f"eval.head_dir={shipped}", "target=hf", f"target.path={tiny_model_dir}",
                                "target.name=tiny"]))
