"""Chat templates a target can be given instead of its own (`target.chat_template`): a named one below, or a
Jinja file. A head serves at its tau only with the template its training data was rendered with; every stage
records the template in the target's fingerprint and the next stage refuses a change. The named templates
exist to measure what a wrong one costs (docs/results/analyses.md, "The chat template"): eval accepts one only with
`eval.allow_template_mismatch=true`.
"""
from __future__ import annotations

from pathlib import Path

# A plain "USER: ... ASSISTANT: ..." transcript in the style of Vicuna's template, written for eaglet: no
# special tokens but the tokenizer's own eos after each answer (so the target still has a token that ends
# its turn). Prefix-stable and honouring add_generation_prompt, as pipeline/data/chat.py requires.
VICUNA = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{ messages[0]['content'] }}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{{ 'A conversation between a user and an assistant. The assistant answers helpfully and politely.' }}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'user' -%}{{ ' USER: ' + message['content'] }}"
    "{%- else -%}{{ ' ASSISTANT: ' + message['content'] + eos_token }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ ' ASSISTANT:' }}{%- endif -%}"
)

NAMED = {"vicuna": VICUNA}


def resolve_chat_template(spec: str) -> str:
    """`target.chat_template` -> the Jinja source: a name of NAMED, or the path of a template file."""
    if spec in NAMED:
        return NAMED[spec]
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"target.chat_template={spec!r}: neither a named template ({', '.join(NAMED)}) nor "
                                f"a file")
    return path.read_text()


def template_label(spec: str) -> str:
    """A short name of `target.chat_template` for run folders: the named template, or the file's stem."""
    return spec if spec in NAMED else Path(spec).stem
