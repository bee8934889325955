"""Greedy (T=0) speculative output is the target's own greedy output, and the check that proves it on every eval.

`follow_greedy` (decoder.py) runs the target's one-token forwards over an answer the speculative decoder emitted, the
layout plain greedy decoding computes: at each step the token the target ranks first, given the same prefix, is held
to the one emitted. Where no step parts, the answer is plain greedy decoding's output token for token (each step sees
the same prefix and is computed alike). Where one parts, this module says whether the two forwards part at a
numerical tie of the precision or the decoder emitted a token the target does not rank first.

In fp32 the check is exact: a parting fails unless the two logits are exactly equal (the bound is 0). In bf16 (and
fp16) the two cannot be promised equal token for token: the verification forward computes a position inside a block
of tree tokens, the one-token forward computes it alone, and the two round differently. At a step where they part,
the one-token forward ranks `a` first (logits z) and the speculative decoder emitted `b`. That is a numerical tie,
not a bug, when the margin z_a - z_b is within what the two layouts' last roundings can move the two logits:

    bound = sum over t in {a, b} of  ulp(z_t) + 2u * sum_i |W_ti| |h_i|

- the logits are rounded to the precision in each layout, at most half an ulp each, so one ulp for two layouts;
- the final hidden state h (the input of the lm_head rows W_t) is rounded in each layout, each element by at most u
  relative (the unit roundoff: 2^-8 in bf16, 2^-11 in fp16), so 2u for two layouts, carried to z_t by |W_ti|.
This counts the last rounding of each layout, the one every layout has. Upstream, the two layouts also round
differently in every layer, and that is not bounded here: the bound is the size of a numerical tie at the output, a
criterion rather than a proof. It is small (a few ulps of the top logit), and a verifier that emits a token the
target does not rank first lands far outside it (tests/test_greedy_check.py breaks the verifier to show that the
check fails). A family whose logits are not a plain lm_head of h (a soft-cap, a scale) gets the ulp term alone.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch

# u: the relative rounding error of round-to-nearest (half the spacing of numbers in [1, 2)); fp32 has no entry: exact.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
SIGNIFICAND_BITS = {torch.bfloat16: 8, torch.float16: 11}


class GreedyPathError(RuntimeError):
    """A T=0 eval's speculative answer holds a token the target does not rank first, by more than a tie."""


def ulp(x: float, dtype: torch.dtype) -> float:
    """Spacing of `dtype` numbers at |x|."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0 ** -126))) - (SIGNIFICAND_BITS[dtype] - 1))


def tie_bound(z: torch.Tensor, h: Optional[torch.Tensor], weight: Optional[torch.Tensor], a: int, b: int,
              dtype: torch.dtype) -> float:
    """The largest margin z_a - z_b that two layouts' last roundings in `dtype` can make (the module's doc): 0 in
    fp32. z: logits [V]; h: the final hidden state [H] and weight: the lm_head [V, H] (None: the ulp term only)."""
    if dtype not in UNIT_ROUNDOFF:
        return 0.0
    u = UNIT_ROUNDOFF[dtype]
    bound = 0.0
    for t in (a, b):
        bound += ulp(float(z[t]), dtype)
        if h is not None and weight is not None:
            bound += 2 * u * float((weight[t].float().abs() * h.float().abs()).sum())
    return bound


@dataclass
class Parting:
    """A step of a speculative answer where the target's one-token forward ranks another token first."""

    step: int  # position in the answer (0: its first token)
    emitted: int  # the speculative decoder's token
    greedy: int  # the one-token forward's first-ranked token
    margin: float  # z[greedy] - z[emitted] in the one-token forward (> 0)
    bound: float  # the precision's tie bound there (0 in fp32)
    verify_gap: Optional[float] = None  # top-1 minus top-2 logit of the verification forward's row there

    @property
    def tie(self) -> bool:
        return self.margin <= self.bound

    def as_dict(self) -> dict:
        return {**asdict(self), "tie": self.tie}


def parting_at(step: int, z: torch.Tensor, h: Optional[torch.Tensor], weight: Optional[torch.Tensor], emitted: int,
               dtype: torch.dtype) -> Optional[Parting]:
    """The parting at `step` if the one-token forward's logits `z` rank a token other than `emitted` first."""
    greedy = int(z.argmax())
    if greedy == emitted:
        return None
    return Parting(step, emitted, greedy, float(z[greedy].float() - z[emitted].float()),
                   tie_bound(z, h, weight, greedy, emitted, dtype))
