"""target.chat_template (pipeline/data/templates.py): a head trained under the target's own template is refused
by an eval that renders chats with another one, unless eval.allow_template_mismatch=true, and then decoding
stays lossless; the vocabulary must match either way, and regen refuses a server backend that would render with
its own template."""
from __future__ import annotations

import dataclasses
import json

import pytest

from pipeline.config import WandbConfig
from pipeline.data.chat import render_prompt
from pipeline.eval.config import EvalConfig, TreeConfig
from pipeline.manifest import ManifestError
from pipeline.regen.config import RegenConfig
from pipeline.target import load_target
from tests.support.decoding import QUESTIONS
from tests.support.exports import fake_train_stage, make_head, stage_config

pytestmark = pytest.mark.usefixtures("single_thread")


def eval_config(tmp_path, tiny_model_dir, tiny_model, **eval_kw):
    cfg = stage_config(tmp_path, tiny_model_dir)
    fake_train_stage(cfg, make_head(tiny_model))  # trained under the tokenizer's own template
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [q, "And then?"]})
                                   for i, q in enumerate(QUESTIONS[:2])) + "\n")
    return dataclasses.replace(
        cfg, stage="eval", target=dataclasses.replace(cfg.target, chat_template="vicuna"),
        tree=TreeConfig(top_k=3, depth=3, total_tokens=10),
        eval=EvalConfig(questions=str(questions), max_new_tokens=16, **eval_kw), wandb=WandbConfig(mode="disabled"))


def test_a_head_of_another_template_is_refused_unless_allowed_and_then_lossless(tiny_model, tiny_model_dir,
                                                                                 tmp_path):
    from pipeline.eval.run import main

    cfg = eval_config(tmp_path, tiny_model_dir, tiny_model)
    with pytest.raises(ManifestError, match="target tokenizer digest mismatch"):
        main(cfg)
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, allow_template_mismatch=True))
    summary = main(cfg)
    out = cfg.stage_dir("eval")
    assert out.name.endswith("-tpl-vicuna") and summary["settings"]["chat_template"] == "vicuna"
    assert summary["greedy_matches_baseline"] == "4/4"  # both turns of both questions: lossless
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    # The prompts were rendered with the plain template: the second turn's prompt holds the first answer.
    target = load_target(cfg.target)
    first = render_prompt(target.tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    assert "USER: " in target.tokenizer.decode(first) and answers[0]["prompt_tokens"] == len(first)


def test_the_vocabulary_must_match_even_when_the_template_may_not(tiny_model, tiny_model_dir, tmp_path):
    from pipeline.eval.run import main

    cfg = eval_config(tmp_path, tiny_model_dir, tiny_model, allow_template_mismatch=True)
    manifest_path = cfg.stage_dir("train") / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["target"]["vocab_digest"] = "0" * 16  # a head of another tokenizer
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="vocab digest mismatch"):
        main(cfg)


def test_regen_renders_another_template_only_in_process(tiny_model_dir, tmp_path):
    from pipeline.regen.run import make_backend, resolve_backend

    cfg = stage_config(tmp_path, tiny_model_dir)
    cfg = dataclasses.replace(cfg, stage="regen", target=dataclasses.replace(cfg.target, chat_template="vicuna"),
                              regen=RegenConfig(backend="openai"))
    assert resolve_backend(dataclasses.replace(cfg, regen=RegenConfig())) == "hf"
    with pytest.raises(ValueError, match="renders each chat with its own template"):
        make_backend(cfg, None)
