"""The bf16 tie check on tiny models: tree decoding against vanilla decoding with a bf16 target (test_bf16_ties.py,
and the GPU kit's device check, tools/gpu/checks.py). The criterion, a numerical tie of the precision at the first
position where the two part, is eval's own (pipeline/decoding/ties.py, where the bound is derived)."""
from __future__ import annotations

from typing import Optional

import torch

from pipeline.decoding.ties import tie_bound

QUESTIONS = ["What is 12 times 7?", "Write a short poem about the sea.", "def add(a, b):",
             "Hello! How can I help you today?", "The quick brown fox", "Speculative decoding drafts tokens"]


@torch.no_grad()
def vanilla_state(model, prompt: list[int], generated: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [V], final hidden state [H]) at the position after prompt + generated, computed as vanilla
    decoding computes it: the prompt in one forward, then one KV-cached token at a time."""
    from transformers import DynamicCache

    from pipeline.decoding.decoder import cache_kwarg

    device = next(model.parameters()).device
    kw = {cache_kwarg(model): DynamicCache(config=model.config), "use_cache": True}
    out = model(torch.tensor([prompt], device=device), output_hidden_states=not generated, logits_to_keep=1, **kw)
    for k, token in enumerate(generated):
        out = model(torch.tensor([[token]], device=device), output_hidden_states=k == len(generated) - 1, **kw)
    return out.logits[0, -1].float(), out.hidden_states[-1][0, -1].float()


@torch.no_grad()
def tie_check(model, prompt: list[int], generated: list[int], a: int, b: int) -> dict:
    """Vanilla picked `a` and the tree decoder `b` after prompt + generated: the margin z_a - z_b against the
    bound above."""
    z, h = vanilla_state(model, prompt, generated)
    bound = tie_bound(z, h, model.get_output_embeddings().weight, a, b, torch.bfloat16)
    margin = float(z[a] - z[b])
    return {"margin": margin, "bound": bound, "tie": margin <= bound, "top": float(z.max())}


def prompts(tokenizer, n: int = len(QUESTIONS)) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS[:n]]


def oracle(vocab_size: int):
    """Drafts from the vanilla continuation, missing 10% of the time (any drafter would do: the verifier
    decides what is emitted)."""
    from tests.support.oracle_drafter import OracleDrafter

    return lambda reference, i: OracleDrafter(reference, vocab_size, miss_rate=0.1, seed=i)


def divergences(model, prompts: list[list[int]], new_tokens: int, drafter_factory, tree=None) -> list[dict]:
    """Tree decoding against vanilla decoding of each prompt (same dtype, greedy); one row per prompt with
    the first differing position, if any, checked against the tie bound."""
    from pipeline.decoding.decoder import generate, vanilla_generate
    from pipeline.decoding.tree import DEFAULT_TREE

    rows = []
    for i, ids in enumerate(prompts):
        base = vanilla_generate(model, ids, new_tokens, eos_token_ids=())
        drafter = drafter_factory(list(ids) + base.tokens, i)
        spec = generate(model, drafter, ids, new_tokens, tree=tree or DEFAULT_TREE, eos_token_ids=())
        at: Optional[int] = next((j for j, (x, y) in enumerate(zip(spec.tokens, base.tokens)) if x != y), None)
        row = {"prompt": i, "identical": spec.tokens == base.tokens, "tau": round(spec.tau, 2)}
        if at is not None:
            row.update(first_divergence=at, **tie_check(model, list(ids), base.tokens[:at], base.tokens[at],
                                                         spec.tokens[at]))
        rows.append(row)
    return rows
