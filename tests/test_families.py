"""Target families beyond Llama (tests/support/families.py): seeded tiny random models of Qwen2, Qwen3, Mistral (sliding
window), Gemma 3 (five sliding-window layers to one global), Phi-3 and Qwen3-MoE, each with its own chat format.

For each family: the loss mask covers exactly the assistant turns (content and end-of-turn token, nothing of the
system prompt, the user turns or the headers); tree decoding equals HF `generate` token for token over 64
tokens, far past the sliding windows; and the whole chain (regen -> dump or online training -> eval with the
tree decoder -> export with its round-trip check) runs through `stage=all`, with eval's greedy output equal to
vanilla decoding on every turn.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from pipeline.data.chat import ChatTemplateError, render_prompt, stop_token_ids, tokenize_conversation
from pipeline.decoding.decoder import generate
from pipeline.decoding.tree import TreeSpec
from pipeline.families import FAMILIES as RECORDS
from pipeline.families import Attention, FinalNorm, attention_layer_types, family_of
from pipeline.manifest import load_manifest
from pipeline.run import run_stages
from tests.support.config import compose_cfg
from tests.support.decoding import hf_greedy
from tests.support.families import FAMILIES, build_family
from tests.support.oracle_drafter import OracleDrafter

pytestmark = pytest.mark.usefixtures("single_thread")

CONVERSATION = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "What is 12 times 7?"},
    {"role": "assistant", "content": "It is 84."},
    {"role": "user", "content": "Write a short poem about the sea."},
    {"role": "assistant", "content": "The wind and the stars."},
]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(Family, local HF directory, tokenizer, fp32 model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fam = FAMILIES[request.param]
    path = build_family(fam, tmp_path_factory.mktemp(fam.name))
    return fam, path, AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs, cur = runs + [cur], []
    return runs + ([cur] if cur else [])


def test_the_loss_mask_is_exactly_the_assistant_turns(family):
    fam, _, tok, model = family
    t = tokenize_conversation(tok, CONVERSATION)
    runs = masked_runs(t.input_ids, t.loss_mask)
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    eot = tok.convert_tokens_to_ids(fam.end_of_turn)
    # One run per assistant turn: the answer (with the separator the format puts before it) and the end of turn.
    assert [tok.decode(r) for r in runs] == [fam.answer_prefix + a + fam.end_of_turn for a in answers]
    assert all(r[-1] == eot for r in runs)
    assert eot in stop_token_ids(tok, model)
    unmasked = tok.decode([i for i, m in zip(t.input_ids, t.loss_mask) if not m])
    assert CONVERSATION[0]["content"] in unmasked and CONVERSATION[3]["content"] in unmasked
    # What the target is asked to continue for turn 2 is exactly the ids before that turn's mask.
    prompt = render_prompt(tok, CONVERSATION[:4])
    assert t.input_ids[:len(prompt)] == prompt and t.loss_mask[len(prompt)] == 1 and t.loss_mask[len(prompt) - 1] == 0


def test_a_template_that_ignores_the_generation_prompt_but_writes_a_header_is_refused(tiny_tokenizer):
    """Mistral's format has no assistant header, so add_generation_prompt adds nothing and is accepted (above);
    ChatML with its generation prompt dropped would put "<|im_start|>assistant\n" in the loss mask and leave it
    out of every prompt."""
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = tok.chat_template.replace("{% if add_generation_prompt %}", "{% if false %}")
    with pytest.raises(ChatTemplateError, match="ignores add_generation_prompt but writes an assistant header"):
        tokenize_conversation(tok, CONVERSATION[1:3])


def test_tree_decoding_equals_hf_generate_past_the_sliding_window(family):
    fam, _, tok, model = family
    prompt = torch.tensor(render_prompt(tok, CONVERSATION[:2]))
    expected = hf_greedy(model, prompt, 64)
    drafter = OracleDrafter(prompt.tolist() + expected, model.config.vocab_size, miss_rate=0.1, seed=1)
    result = generate(model, drafter, prompt, 64, tree=TreeSpec(4, 4, 16), eos_token_ids=())
    assert result.tokens == expected
    assert result.tau > 3  # long accepted paths: the cache compaction and the masks are exercised
    window = getattr(model.config, "sliding_window", None)
    if "sliding_attention" in attention_layer_types(model.config):
        assert window is not None and len(prompt) + 64 > 3 * window


def test_a_layer_kind_the_tree_mask_cannot_express_is_refused_by_name(family):
    _, _, _, model = family
    config = type(model.config).from_dict(model.config.to_dict())
    config.layer_types = ["linear_attention"] + ["full_attention"] * (config.num_hidden_layers - 1)
    with pytest.raises(NotImplementedError, match=r"layers of kind \['linear_attention'\] cannot be verified"):
        attention_layer_types(config)


def test_the_family_record_says_what_the_transformers_class_does(family):
    """pipeline/families.py holds one record per family instead of probing configs: each claim of the record
    is checked here against the family's real transformers class (a wrong record fails, not a decode later)."""
    fam, _, tok, model = family
    config = model.config
    record = family_of(config)
    assert RECORDS.get(config.model_type) is record, f"{config.model_type} has no record in pipeline/families.py"
    ids = torch.tensor([[3, 17, 42, 9]])
    with torch.no_grad():
        hidden = model.base_model(ids).last_hidden_state  # [1, 4, H], after the final norm
        if record.plain_logits:
            assert torch.equal(model.lm_head(hidden), model(ids).logits)
        norm = copy.deepcopy(model.base_model.norm)
        norm.weight.copy_(torch.randn_like(norm.weight))
        x = torch.randn(2, config.hidden_size)
        x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
        scale = norm.weight + 1 if record.final_norm == FinalNorm.rms_one_plus else norm.weight
        torch.testing.assert_close(norm(x), scale * x_hat, rtol=1e-5, atol=1e-5)
        embedded = model.get_input_embeddings()(ids)
        rows = model.get_input_embeddings().weight[ids]
        torch.testing.assert_close(embedded, rows * config.hidden_size ** 0.5 if record.embed_scale else rows)
    assert record.tied_embeddings == type(config)().tie_word_embeddings
    assert record.tensor_parallel == bool(config.base_model_tp_plan)
    assert (record.attention == Attention.layer_types) == (getattr(config, "layer_types", None) is not None)
    user = [{"role": "user", "content": "Hi"}]
    render = lambda messages, **kw: tok.apply_chat_template(messages, tokenize=False, **kw)  # noqa: E731
    folded = render([{"role": "user", "content": "Be brief.\n\nHi"}])
    assert (render([{"role": "system", "content": "Be brief."}, *user]) == folded) == (not record.chat.system_role)
    assert (render(user, add_generation_prompt=True) == render(user)) == (not record.chat.assistant_header)


QUESTIONS = [{"question_id": 1, "category": "math", "turns": ["What is 12 times 7?", "And 12 times 8?"]},
             {"question_id": 2, "category": "chat", "turns": ["Write a short poem about the sea."]}]


def test_the_whole_chain_runs_and_decodes_losslessly(family, tmp_path):
    fam, path, _, _ = family
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    source = "online" if fam.name in ("qwen3", "gemma3", "qwen3_moe") else "dump"  # both sources, three each
    cfg = compose_cfg([
        "stage=all", "experiment=demo", f"output_root={tmp_path}", "target=hf", f"target.path={path}",
        f"target.name={fam.name}", "regen.limit=6", "regen.max_new_tokens=16", "regen.batch_size=6",
        "head.draft_vocab_size=200", "head.ttt_steps=2", f"train.source={source}", "train.epochs=1",
        "train.micro_batch_tokens=256", "train.save_every=0", "train.eval_every=0", "train.tau_prompts=0",
        "train.val_fraction=0.2", "wandb.mode=disabled", f"eval.questions={questions}", "eval.max_new_tokens=24",
        "tree.depth=3", "tree.top_k=3", "tree.total_tokens=8", "export.verify=true", "export.dtype=float32"])
    run_stages(cfg)
    exp = tmp_path / cfg.name
    assert load_manifest(exp / "train" / "eagle3", "train")["source"] == source
    assert (exp / "dump").exists() == (source == "dump")
    run = next((exp / "eval" / "eagle3").iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["turns"] == 3 and summary["greedy_matches_baseline"] == "3/3"
    export = load_manifest(exp / "export" / "eagle3" / "sglang", "export")
    assert export["counts"]["max_logit_diff"] == 0
    assert export["target"]["config"]["model_type"] == model_type_of(path)


def model_type_of(path) -> str:
    return json.loads((path / "config.json").read_text())["model_type"]
