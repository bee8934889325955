"""regen.thinking=on|off|template: the chat template's reasoning switch (Qwen3's enable_thinking), on the tiny
Qwen3 family with a template that has the switch as Qwen3's does (off: an empty think block opens every assistant
turn and the generation prompt; on / undefined: the model writes its own). Regen renders with the mode and records
it, the dump tokenizes with it, train and eval refuse an input of another mode (eval unless allowed), and eval
renders its prompts with it."""
from __future__ import annotations

import dataclasses
import json

import pytest

from pipeline.config import EagletConfig, WandbConfig
from pipeline.data.chat import (
    ChatTemplateError,
    ThinkingMode,
    render_prompt,
    template_kwargs,
    tokenize_conversation,
)
from pipeline.data.config import DataConfig
from pipeline.dist import rank_info
from pipeline.eval.config import EvalConfig, TreeConfig
from pipeline.heads import Eagle3HeadConfig
from pipeline.hidden_states.config import DumpConfig
from pipeline.hidden_states.reader import DumpReader
from pipeline.manifest import ManifestError, load_manifest
from pipeline.regen.config import RegenConfig
from pipeline.target import TargetConfig, load_target
from pipeline.train.config import TrainConfig
from tests.support.families import FAMILIES, build_family

pytestmark = pytest.mark.usefixtures("single_thread")

EMPTY_THINK = "<think>\n\n</think>\n\n"
# Qwen3's switch, prefix-stable: `enable_thinking=false` puts the empty think block the model answers after into
# the generation prompt and into each assistant turn; true or undefined (Qwen3's default: thinking) adds nothing.
QWEN3_THINKING_TEMPLATE = (
    "{% set think = '<think>\n\n</think>\n\n' if enable_thinking is defined and enable_thinking is false else '' %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' + think + m['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' + think }}{% endif %}"
)
CONVERSATION = [{"role": "user", "content": "What is 12 times 7?"}, {"role": "assistant", "content": "It is 84."},
                {"role": "user", "content": "And times 8?"}, {"role": "assistant", "content": "96."}]
PROMPTS = ["What is 12 times 7?", "Write a short poem about the sea.", "Hello!", "The quick brown fox"]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    family = dataclasses.replace(FAMILIES["qwen3"], template=QWEN3_THINKING_TEMPLATE)
    return build_family(family, tmp_path_factory.mktemp("qwen3-thinking"))


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir):
    return load_target(TargetConfig(name="qwen3", path=str(qwen3_dir), gguf_package=None)).tokenizer


def _text(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False)


def test_on_and_template_render_alike_off_adds_the_empty_think_block(tokenizer):
    assert template_kwargs("template") == {} and template_kwargs("on") == {"enable_thinking": True}
    assert template_kwargs(ThinkingMode.off) == {"enable_thinking": False}
    user = CONVERSATION[:1]
    by_mode = {m: render_prompt(tokenizer, user, thinking=m) for m in ThinkingMode}
    assert by_mode[ThinkingMode.on] == by_mode[ThinkingMode.template]  # Qwen3 thinks unless told not to
    assert _text(tokenizer, by_mode[ThinkingMode.template]).endswith("<|im_start|>assistant\n")
    assert _text(tokenizer, by_mode[ThinkingMode.off]).endswith("<|im_start|>assistant\n" + EMPTY_THINK)

    off = tokenize_conversation(tokenizer, CONVERSATION, thinking="off")
    default = tokenize_conversation(tokenizer, CONVERSATION)
    assert _text(tokenizer, off.input_ids).count(EMPTY_THINK) == 2 and EMPTY_THINK not in _text(tokenizer,
                                                                                                 default.input_ids)
    # The think block is prompt (what the model answered after), never loss: the masked tokens are the same.
    masked = [[t for t, m in zip(x.input_ids, x.loss_mask) if m] for x in (off, default)]
    assert masked[0] == masked[1] and _text(tokenizer, masked[0]) == "It is 84.<|im_end|>96.<|im_end|>"
    # Regen's and eval's prompt is a prefix of the dump's row, in each mode.
    for mode, full in (("off", off), ("template", default)):
        prompt = render_prompt(tokenizer, CONVERSATION[:3], thinking=mode)
        assert full.input_ids[:len(prompt)] == prompt


def test_a_template_without_the_switch_refuses_on_and_off(tiny_tokenizer):
    assert "enable_thinking" not in tiny_tokenizer.chat_template  # plain ChatML
    assert render_prompt(tiny_tokenizer, CONVERSATION[:1], thinking="template")
    for mode in ("on", "off"):
        with pytest.raises(ChatTemplateError, match=f"regen.thinking={mode}: this chat template ignores "
                                                    "enable_thinking .* use regen.thinking=template"):
            render_prompt(tiny_tokenizer, CONVERSATION[:1], thinking=mode)
        with pytest.raises(ChatTemplateError, match="ignores enable_thinking"):
            tokenize_conversation(tiny_tokenizer, CONVERSATION, thinking=mode)
    with pytest.raises(ValueError, match="regen.thinking='maybe': choose one of on, off, template"):
        RegenConfig(thinking="maybe")


def test_regen_refuses_on_for_a_template_without_the_switch(tiny_model_dir):
    from pipeline.regen.hf_backend import HFBackend

    target = load_target(TargetConfig(name="tiny", path=str(tiny_model_dir), gguf_package=None))
    with pytest.raises(ChatTemplateError, match="regen.thinking=on: this chat template ignores enable_thinking"):
        HFBackend(target, 4, thinking="on")


def _config(tmp_path, qwen3_dir, source, thinking, stage="regen", **kw) -> EagletConfig:
    return EagletConfig(
        stage=stage, name="think", output_root=str(tmp_path / "out"),
        target=TargetConfig(name="qwen3", path=str(qwen3_dir), gguf_package=None),
        data=DataConfig(name="tiny", sources=[str(source)], max_length=96),
        regen=RegenConfig(backend="hf", batch_size=2, batches_per_shard=2, max_new_tokens=6, progress=False,
                          thinking=thinking),
        dump=DumpConfig(), head=Eagle3HeadConfig(name="h", draft_vocab_size=64, ttt_steps=2),
        train=TrainConfig(max_steps=2, warmup_steps=1, micro_batch_tokens=256, val_fraction=0.25, save_every=0,
                          eval_every=0, tau_prompts=0, plot=False, log_every=1),
        wandb=WandbConfig(mode="disabled"), **kw)


def test_the_mode_goes_from_regen_through_dump_and_train_to_eval(qwen3_dir, tokenizer, tmp_path):
    from pipeline.eval.run import main as eval_main
    from pipeline.hidden_states.run import main as dump_main
    from pipeline.regen.hf_backend import HFBackend
    from pipeline.regen.run import main as regen_main
    from pipeline.regen.run import make_backend
    from pipeline.train.run import main as train_main

    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": f"p{i}", "conversations": [{"from": "human", "value": q}]}) + "\n"
                              for i, q in enumerate(PROMPTS)))
    cfg = _config(tmp_path, qwen3_dir, source, "off")
    target = load_target(cfg.target)
    prompt = HFBackend(target, 4, thinking="off").prompt_ids(CONVERSATION[:1])  # what regen's target continues
    assert _text(tokenizer, prompt).endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    regen_main(cfg)
    regen = load_manifest(cfg.stage_dir("regen"), expect_stage="regen")
    assert regen["generation"]["thinking"] == "off"
    # The default records nothing, so runs started before the switch existed resume unchanged.
    assert "thinking" not in make_backend(_config(tmp_path, qwen3_dir, source, "template"), rank_info())[2]

    # A later stage of another mode is refused in one line naming both modes and the setting.
    for other in ("on", "template"):
        with pytest.raises(ManifestError, match=f"made with regen.thinking=off, this run renders with "
                                                f"regen.thinking={other}; set regen.thinking=off$"):
            dump_main(_config(tmp_path, qwen3_dir, source, other, stage="dump"))

    dump_main(dataclasses.replace(cfg, stage="dump"))
    reader = DumpReader(cfg.stage_dir("dump"))
    assert reader.manifest.thinking == "off" and len(reader) == len(PROMPTS)
    for i in range(len(reader)):
        row = reader[i]
        ids, mask = row.input_ids.tolist(), row.loss_mask.tolist()
        start = mask.index(1)
        # Each answer follows the generation prompt it was generated after: the empty think block, unmasked.
        assert _text(tokenizer, ids[:start]).endswith("<|im_start|>assistant\n" + EMPTY_THINK)
        assert EMPTY_THINK not in _text(tokenizer, [t for t, m in zip(ids, mask) if m])

    with pytest.raises(ManifestError, match="dump/manifest.json was made with regen.thinking=off, this run renders "
                                            "with regen.thinking=template"):
        train_main(_config(tmp_path, qwen3_dir, source, "template", stage="train"))
    train_main(dataclasses.replace(cfg, stage="train"))
    assert load_manifest(cfg.stage_dir("train"), expect_stage="train")["thinking"] == "off"

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "c", "turns": [PROMPTS[0]]}) + "\n")
    evaluation = dict(tree=TreeConfig(top_k=2, depth=2, total_tokens=4),
                      eval=EvalConfig(questions=str(questions), max_new_tokens=4, baseline=False))
    with pytest.raises(ManifestError, match="made with regen.thinking=off, this run renders with regen.thinking="
                                            "template; set regen.thinking=off .or eval.allow_thinking_mismatch=true"):
        eval_main(_config(tmp_path, qwen3_dir, source, "template", stage="eval", **evaluation))
    eval_cfg = _config(tmp_path, qwen3_dir, source, "off", stage="eval", **evaluation)
    summary = eval_main(eval_cfg)
    out = eval_cfg.stage_dir("eval")
    assert out.name.endswith("-think-off") and summary["settings"]["thinking"] == "off"
    answer = json.loads((out / "answers.jsonl").read_text().splitlines()[0])
    prompt = {m: render_prompt(tokenizer, [{"role": "user", "content": PROMPTS[0]}], thinking=m) for m in ("off", "on")}
    assert len(prompt["off"]) != len(prompt["on"]) and answer["prompt_tokens"] == len(prompt["off"])
