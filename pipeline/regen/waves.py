"""One batch of conversations, answered in waves.

Turn k of a conversation needs the target's answer to turn k-1, so a batch is answered wave by wave: wave k
asks every conversation that has a k-th user turn, with the history regenerated so far. A conversation whose
request fails is dropped from later waves and reported; the rest of the batch goes on.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol, Union

from pipeline.regen.batching import RegenItem, derive_seed

ON_DEGENERATE = ("flag", "drop")


@dataclass
class Answer:
    text: str
    n_tokens: int  # generated tokens, the end-of-turn token included when it was generated
    finish_reason: str  # "stop" (end of turn / EOS) | "length" (cut at max_new_tokens)


@dataclass
class Failure:
    reason: str  # e.g. prompt_too_long, timeout, connection_error, http_400, bad_response
    detail: str = ""
    attempts: int = 1


@dataclass
class Request:
    messages: list[dict]  # the conversation so far, ending with the user turn to answer
    seed: int  # per (conversation, turn): sampling does not depend on batch-mates where the backend allows


class Backend(Protocol):
    name: str

    def prompt_length(self, item: RegenItem) -> int: ...

    def generate(self, requests: list[Request]) -> list[Union[Answer, Failure]]: ...


@dataclass
class BatchResult:
    records: list[dict]  # ShareGPT records, in batch order
    failures: list[dict]  # {"id", "turn", "reason", "detail", "attempts"}
    stats: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"records": self.records, "failures": self.failures, "stats": self.stats}

    @classmethod
    def from_dict(cls, d: dict) -> "BatchResult":
        return cls(d["records"], d["failures"], d["stats"])


def degenerate_flags(answer: Answer) -> list[str]:
    flags = []
    if not answer.text.strip():
        flags.append("empty")
    if answer.finish_reason == "length":
        flags.append("truncated")
    return flags


def to_sharegpt(item: RegenItem, answers: list[Answer], flags: dict[str, list[int]]) -> dict:
    turns = [{"from": "system", "value": item.system}] if item.system is not None else []
    for question, answer in zip(item.user_turns, answers):
        turns += [{"from": "human", "value": question}, {"from": "gpt", "value": answer.text}]
    record = {"id": item.id, "conversations": turns}
    record.update({k: v for k, v in item.meta.items() if k not in ("id", "conversations")})
    if flags:
        record["regen_flags"] = flags  # {"empty": [turn, ...], "truncated": [...]}, turns 0-based
    return record


def regen_batch(backend: Backend, items: list[RegenItem], seed: int, on_degenerate: str = "flag") -> BatchResult:
    if on_degenerate not in ON_DEGENERATE:
        raise ValueError(f"regen.on_degenerate must be one of {ON_DEGENERATE}, got {on_degenerate!r}")
    t0 = time.perf_counter()
    histories = [item.prefix() for item in items]
    answers: list[list[Answer]] = [[] for _ in items]
    failed: dict[int, dict] = {}
    n_tokens = 0
    for turn in range(max(len(item.user_turns) for item in items)):
        active = [i for i, item in enumerate(items) if turn < len(item.user_turns) and i not in failed]
        if not active:
            break
        for i in active:
            histories[i].append({"role": "user", "content": items[i].user_turns[turn]})
        requests = [Request(list(histories[i]), derive_seed(seed, items[i].id, turn)) for i in active]
        for i, out in zip(active, backend.generate(requests)):
            if isinstance(out, Failure):
                failed[i] = {"id": items[i].id, "turn": turn, "reason": out.reason, "detail": out.detail,
                             "attempts": out.attempts}
                continue
            n_tokens += out.n_tokens
            answers[i].append(out)
            histories[i].append({"role": "assistant", "content": out.text})

    records, degenerate, dropped = [], Counter(), 0
    for i, item in enumerate(items):
        if i in failed:
            continue
        flags: dict[str, list[int]] = {}
        for turn, answer in enumerate(answers[i]):
            for flag in degenerate_flags(answer):
                flags.setdefault(flag, []).append(turn)
                degenerate[flag] += 1
        if flags and on_degenerate == "drop":
            dropped += 1
            continue
        records.append(to_sharegpt(item, answers[i], flags))
    stats = {
        "conversations": len(items),
        "written": len(records),
        "turns": sum(len(a) for a in answers),
        "tokens": n_tokens,
        "generation_s": time.perf_counter() - t0,
        "degenerate_turns": dict(degenerate),
        "dropped_degenerate": dropped,
        "failed": len(failed),
        "failures_by_reason": dict(Counter(f["reason"] for f in failed.values())),
    }
    return BatchResult(records, list(failed.values()), stats)
