"""Greedy decoding references (test_lossless.py, shared with the tests of other drafters and heads): the test
questions, a question as chat-template prompt ids, and HF `generate`'s greedy continuation."""
from __future__ import annotations

import torch

QUESTIONS = [
    "What is 12 times 7?",
    "Write a short poem about the sea, the wind and the stars.",
    "def add(a, b):",
]


def chat_ids(tokenizer, question: str) -> torch.Tensor:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])


def hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int, eos=None) -> list[int]:
    prompt = prompt.to(model.device)
    out = model.generate(prompt[None], do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                         pad_token_id=0, attention_mask=torch.ones_like(prompt[None]))
    return out[0, len(prompt):].tolist()
