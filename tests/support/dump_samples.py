"""Tokenized conversations for the dump's tests (test_dump.py, shared with test_dump_kill.py): seeded random
conversations of varied lengths over a small vocabulary of words."""
from __future__ import annotations

import random

from pipeline.data.chat import tokenize_conversation
from pipeline.hidden_states.plan import TokenizedSample

WORDS = ("draft head verifies tokens the target accepts tree branch layer state cache shard batch "
         "residual stream norm logits rank resume").split()


def make_conversation(i: int) -> list[dict]:
    rng = random.Random(i)
    question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 25)))
    answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
    return [{"role": "user", "content": f"Question {i}: {question}?"}, {"role": "assistant", "content": answer}]


def make_samples(tokenizer, n: int) -> list[TokenizedSample]:
    out = []
    for i in range(n):
        tok = tokenize_conversation(tokenizer, make_conversation(i), max_length=512)
        out.append(TokenizedSample(f"conv-{i}", tok.input_ids, tok.loss_mask))
    return out
