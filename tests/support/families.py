"""Seeded tiny random targets of the model families eaglet is tested on, each built from transformers' own
config class and given a chat template in that family's own turn format (its special tokens, its handling of
the system prompt, its end-of-turn token) added to a test BPE tokenizer.

The templates are written here from each family's documented turn format, shortened to what the pipeline
exercises: system handling, the assistant header (or its absence), the end-of-turn token and the text after
it. They are not the families' full templates (tool calls, thinking blocks and the like are left out).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tests.support.tiny import build_tiny_tokenizer

# ChatML (Qwen 2/2.5/3): <|im_start|>role\n ... <|im_end|>\n; Qwen 2.5 inserts a default system message.
QWEN2_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are Qwen, a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN3_TEMPLATE = (  # no default system message
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Mistral / Mixtral ([INST] format): bos once, the system text prepended to the first user turn, no assistant
# header at all (the generation prompt adds nothing), the answer closed by eos.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + (system if loop.first else '') + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}"
    "{% else %}{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% endfor %}"
)
# Gemma 3: bos, <start_of_turn>user|model\n ... <end_of_turn>\n, no system role (folded into the first user turn).
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (system if loop.first else '') + m['content'] + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Phi-3: <|system|>, <|user|>, <|assistant|> headers, each turn closed by <|end|>; eos is <|endoftext|>.
PHI3_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=2048, rms_norm_eps=1e-6)


@dataclass(frozen=True)
class Family:
    name: str
    make_config: Callable[[], object]  # transformers config, vocab size and special ids set by `build`
    template: str
    specials: tuple[str, ...]  # pad first
    bos: str
    eos: str
    end_of_turn: str  # the token an assistant turn ends with (the loss mask's last token of a turn)
    answer_prefix: str = ""  # what the format writes between the prompt and the answer (Mistral: a space)


def _qwen2():
    from transformers import Qwen2Config
    # Untied, as Qwen2.5-7B and up: a tied random model only echoes its last input token (its residual stream is
    # that token's embedding, which the tied lm_head scores highest), and SmolLM2 covers tied targets.
    return Qwen2Config(**_SMALL, num_hidden_layers=7, tie_word_embeddings=False)


def _qwen3():
    from transformers import Qwen3Config
    return Qwen3Config(**_SMALL, num_hidden_layers=7, head_dim=32, tie_word_embeddings=False)


def _mistral():
    from transformers import MistralConfig
    # Mistral-7B-v0.1's sliding window, scaled down so the tests decode past it.
    return MistralConfig(**_SMALL, num_hidden_layers=7, sliding_window=24, tie_word_embeddings=False)


def _gemma3():
    from transformers import Gemma3TextConfig
    # Gemma 3's pattern, five sliding-window (local) layers to one global layer (then local again), with a
    # window of 8 tokens so that decoding runs far past it.
    return Gemma3TextConfig(**_SMALL, num_hidden_layers=7, head_dim=16, sliding_window=8,
                            layer_types=["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
                            query_pre_attn_scalar=16)


def _phi3():
    from transformers import Phi3Config
    return Phi3Config(**_SMALL, num_hidden_layers=7, tie_word_embeddings=False)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(**_SMALL, num_hidden_layers=7, head_dim=32, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=64, decoder_sparse_step=1, tie_word_embeddings=False)


CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
FAMILIES = {f.name: f for f in [
    Family("qwen2", _qwen2, QWEN2_TEMPLATE, CHATML, "<|im_start|>", "<|endoftext|>", "<|im_end|>"),
    Family("qwen3", _qwen3, QWEN3_TEMPLATE, CHATML, "<|im_start|>", "<|im_end|>", "<|im_end|>"),
    Family("mistral", _mistral, MISTRAL_TEMPLATE, ("<pad>", "<s>", "</s>", "[INST]", "[/INST]"), "<s>", "</s>",
           "</s>", answer_prefix=" "),
    Family("gemma3", _gemma3, GEMMA3_TEMPLATE, ("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
           "<bos>", "<eos>", "<end_of_turn>"),
    Family("phi3", _phi3, PHI3_TEMPLATE,
           ("<|endoftext|>", "<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), "<s>", "<|endoftext|>",
           "<|end|>"),
    Family("qwen3_moe", _qwen3_moe, QWEN3_TEMPLATE, CHATML, "<|im_start|>", "<|im_end|>", "<|im_end|>"),
]}


def build_family(family: Family, path: Path, seed: int = 0) -> Path:
    """Writes a local HF directory (config, safetensors, tokenizer with the family's template) to `path`."""
    from transformers import AutoModelForCausalLM

    tok = build_tiny_tokenizer(specials=family.specials, bos=family.bos, eos=family.eos, template=family.template)
    cfg = family.make_config()
    cfg.vocab_size = len(tok)
    cfg.pad_token_id = tok.pad_token_id
    cfg.bos_token_id = tok.bos_token_id
    cfg.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():  # decisive greedy paths, as the tiny Llama's (tests/support/tiny.build_tiny_llama)
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def build_padded_moe(path: Path, experts: int = 256, moe_intermediate: int = 1536, seed: int = 0) -> tuple[Path, int]:
    """(a tiny Qwen3-MoE padded where large targets keep their weights, its weights' bytes in fp32): 256 experts in
    each of 7 layers, stored in bf16 (1 GB on disk, 2 GB in fp32). A head copies the target's hidden and dense MLP
    sizes, which stay tiny: what a stage holds beyond the head is the target's."""
    from transformers import AutoModelForCausalLM

    family = FAMILIES["qwen3_moe"]
    tok = build_tiny_tokenizer(specials=family.specials, bos=family.bos, eos=family.eos, template=family.template)
    cfg = family.make_config()
    cfg.num_experts, cfg.moe_intermediate_size = experts, moe_intermediate
    cfg.vocab_size, cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = (
        len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters()) * 4
