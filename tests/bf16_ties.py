"""The bf16 tie criterion: tree decoding against vanilla decoding with a bf16 target (test_bf16_ties.py, and the
GPU kit's device check, bench/gpu/checks.py).

In bf16 the two cannot be promised equal token for token: the verification forward computes a position inside a
block of tree tokens, vanilla decoding computes it alone, and the two round differently. At the first position
where they part, both saw the same tokens before it, vanilla picked `a` (argmax of its logits z) and the tree
decoder `b`. That is a numerical tie, not a bug, when the margin z_a - z_b is within what the two layouts' last
roundings can move the two logits:

    bound = sum over t in {a, b} of  ulp(z_t) + u * sum_i |W_ti| |h_i|

- the logits are bf16: each path rounds z_t to bf16, at most half an ulp each, so one ulp for two paths;
- the final hidden state h (bf16, input of the lm_head rows W_t) is rounded once in each path: each element
  moves by at most u/2 relative (u = 2^-8, bf16's unit roundoff), so u for two paths, carried to z_t by
  |W_ti| exactly.
Differences further upstream enter only through h, so the bound counts the last rounding of each path, the
one every layout has; it is small (a few ulps of the top logit), and a verifier that emits a token which is not
the target's argmax lands far outside it (test_bf16_ties.py breaks the verifier to show that the check fails).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

BF16_UNIT_ROUNDOFF = 2.0 ** -8  # u: relative rounding error of round-to-nearest with 8 significant bits


def bf16_ulp(x: float) -> float:
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0 ** -126))) - 7)


@torch.no_grad()
def vanilla_state(model, prompt: list[int], generated: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [V], final hidden state [H]) at the position after prompt + generated, computed as vanilla
    decoding computes it: the prompt in one forward, then one KV-cached token at a time."""
    from transformers import DynamicCache

    from pipeline.eval.decoder import cache_kwarg

    device = next(model.parameters()).device
    kw = {cache_kwarg(model): DynamicCache(config=model.config), "use_cache": True}
    out = model(torch.tensor([prompt], device=device), output_hidden_states=not generated, **kw)
    for k, token in enumerate(generated):
        out = model(torch.tensor([[token]], device=device), output_hidden_states=k == len(generated) - 1, **kw)
    return out.logits[0, -1].float(), out.hidden_states[-1][0, -1].float()


@torch.no_grad()
def tie_check(model, prompt: list[int], generated: list[int], a: int, b: int) -> dict:
    """Vanilla picked `a` and the tree decoder `b` after prompt + generated: the margin z_a - z_b against the
    bound above."""
    z, h = vanilla_state(model, prompt, generated)
    w = model.get_output_embeddings().weight
    bound = sum(bf16_ulp(float(z[t])) + BF16_UNIT_ROUNDOFF * float((w[t].float().abs() * h.abs()).sum())
                for t in (a, b))
    margin = float(z[a] - z[b])
    return {"margin": margin, "bound": bound, "tie": margin <= bound, "top": float(z.max())}


def divergences(model, prompts: list[list[int]], new_tokens: int, drafter_factory, tree=(10, 6, 60)) -> list[dict]:
    """Tree decoding against vanilla decoding of each prompt (same dtype, greedy); one row per prompt with
    the first differing position, if any, checked against the tie bound."""
    from pipeline.eval.decoder import generate, vanilla_generate

    rows = []
    for i, ids in enumerate(prompts):
        base = vanilla_generate(model, ids, new_tokens, eos_token_ids=())
        drafter = drafter_factory(list(ids) + base.tokens, i)
        spec = generate(model, drafter, ids, new_tokens, top_k=tree[0], depth=tree[1], total_tokens=tree[2],
                        eos_token_ids=())
        at: Optional[int] = next((j for j, (x, y) in enumerate(zip(spec.tokens, base.tokens)) if x != y), None)
        row = {"prompt": i, "identical": spec.tokens == base.tokens, "tau": round(spec.tau, 2)}
        if at is not None:
            row.update(first_divergence=at, **tie_check(model, list(ids), base.tokens[:at], base.tokens[at],
                                                         spec.tokens[at]))
        rows.append(row)
    return rows
