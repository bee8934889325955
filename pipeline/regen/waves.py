"""One batch of conversations, answered turn after turn.

Turn k of a conversation needs the target's answer to turn k-1. Two schedules:
- waves, for backends that generate a list of requests as one batch (hf): wave k asks every conversation
  that has a k-th user turn, with the history regenerated so far;
- per conversation, for backends that serve concurrent requests themselves (a server with parallel slots
  and continuous batching, `Backend.concurrency`): each conversation asks its next turn as soon as its
  previous answer returns, so the server's slots never wait for a wave's slowest answer.
A conversation whose request fails stops there; the rest of the batch goes on. A failure for good (a prompt
longer than the context, an HTTP 400) is reported in the shard's errors; a transient one (connection, timeout,
overload, still failing after the backend's retries) leaves the conversation pending: its batch is not saved,
and a rerun asks it again. Both schedules send the same requests (same history, same per-turn seed) and give
the same records. A rank's conversations stream through a concurrent backend across batches (stream.py).

The per-conversation schedule also journals each finished conversation (`Journal`): a batch of hundreds of
conversations takes an hour or more on a CPU server, and a killed run resumes it with only the unfinished
conversations. Waves are not journaled: a wave schedule's batch is the size of one model batch.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Protocol, Union

from pipeline.regen.batching import RegenItem, derive_seed
from pipeline.regen.config import OnDegenerate


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
    # True: the same request may succeed later (a server down or overloaded): the conversation stays pending.
    retryable: bool = False


@dataclass
class Request:
    messages: list[dict]  # the conversation so far, ending with the user turn to answer
    seed: int  # per (conversation, turn): sampling does not depend on batch-mates where the backend allows


class Journal(Protocol):
    """Finished conversations of one batch, kept across a kill (RegenDir.journal)."""

    def load(self) -> tuple[dict[str, list[Answer]], float]: ...  # answers by conversation id, seconds spent

    def record(self, conversation_id: str, answers: list[Answer], elapsed_s: float) -> None: ...


class Backend(Protocol):
    name: str
    # > 0: requests may be sent one at a time from this many threads (per-conversation schedule, `complete`);
    # 0: one batch per wave (`generate`).
    concurrency: int

    def prompt_length(self, item: RegenItem) -> int: ...

    def generate(self, requests: list[Request]) -> list[Union[Answer, Failure]]: ...

    def complete(self, request: Request) -> Union[Answer, Failure]: ...


@dataclass
class BatchResult:
    records: list[dict]  # ShareGPT records, in batch order
    failures: list[dict]  # failed for good: {"id", "turn", "reason", "detail", "attempts", "retryable"}
    stats: dict = field(default_factory=dict)
    # Transient failures: those conversations are pending, so the batch must not be saved (a rerun asks them).
    pending: list[dict] = field(default_factory=list)

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


def _failure(item: RegenItem, turn: int, out: Failure) -> dict:
    return {"id": item.id, "turn": turn, "reason": out.reason, "detail": out.detail, "attempts": out.attempts,
            "retryable": out.retryable}


def _by_waves(backend: Backend, items: list[RegenItem], seed: int) -> tuple[list[list[Answer]], dict[int, dict]]:
    histories = [item.prefix() for item in items]
    answers: list[list[Answer]] = [[] for _ in items]
    failed: dict[int, dict] = {}
    for turn in range(max(len(item.user_turns) for item in items)):
        active = [i for i, item in enumerate(items) if turn < len(item.user_turns) and i not in failed]
        if not active:
            break
        for i in active:
            histories[i].append({"role": "user", "content": items[i].user_turns[turn]})
        requests = [Request(list(histories[i]), derive_seed(seed, items[i].id, turn)) for i in active]
        for i, out in zip(active, backend.generate(requests)):
            if isinstance(out, Failure):
                failed[i] = _failure(items[i], turn, out)
                continue
            answers[i].append(out)
            histories[i].append({"role": "assistant", "content": out.text})
    return answers, failed


class Stopped(Exception):
    """A conversation noticed that the batch was given up (another failed, or the run was interrupted)."""


def answer_conversation(backend: Backend, item: RegenItem, seed: int, stop: threading.Event,
                        journal: Optional[Journal], clock) -> tuple[list[Answer], Optional[dict]]:
    """Every turn of one conversation, each asked as soon as the previous answer returns; (answers, failure)."""
    history, answers = item.prefix(), []
    for turn, question in enumerate(item.user_turns):
        if stop.is_set():
            raise Stopped(item.id)
        history.append({"role": "user", "content": question})
        out = backend.complete(Request(list(history), derive_seed(seed, item.id, turn)))
        if isinstance(out, Failure):
            return answers, _failure(item, turn, out)
        answers.append(out)
        history.append({"role": "assistant", "content": out.text})
    if journal is not None:  # failed conversations are not journaled: a resumed run asks them again
        journal.record(item.id, answers, clock())
    return answers, None


def _by_conversation(backend: Backend, items: list[RegenItem], seed: int, journal: Optional[Journal] = None
                     ) -> tuple[list[list[Answer]], dict[int, dict], float]:
    finished, spent = journal.load() if journal is not None else ({}, 0.0)
    t0 = time.perf_counter()

    def clock() -> float:  # seconds over every attempt at this batch
        return spent + time.perf_counter() - t0

    done = {i: (finished[item.id], None) for i, item in enumerate(items) if item.id in finished}
    # Longest conversations first: they bound the batch's time, so they must not start last.
    order = sorted((i for i in range(len(items)) if i not in done), key=lambda i: -len(items[i].user_turns))
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=backend.concurrency, thread_name_prefix="regen-conv")
    try:
        futures = {i: pool.submit(answer_conversation, backend, items[i], seed, stop, journal, clock) for i in order}
        done.update({i: futures[i].result() for i in order})
    except BaseException:
        # An error (a dead server) or an interrupt: no conversation asks another turn, and the caller can
        # stop the server at once instead of waiting for every conversation to finish its turns.
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    answers = [done[i][0] for i in range(len(items))]
    failed = {i: done[i][1] for i in range(len(items)) if done[i][1] is not None}
    return answers, failed, clock()


def regen_batch(backend: Backend, items: list[RegenItem], seed: int, on_degenerate: str = "flag",
                journal: Optional[Journal] = None) -> BatchResult:
    """One batch's records; `journal` (per-conversation schedule only) resumes a batch a kill interrupted."""
    t0 = time.perf_counter()
    if getattr(backend, "concurrency", 0) > 0:
        answers, failed, generation_s = _by_conversation(backend, items, seed, journal)
        return assemble(items, answers, failed, on_degenerate, generation_s, "conversation")
    answers, failed = _by_waves(backend, items, seed)
    return assemble(items, answers, failed, on_degenerate, time.perf_counter() - t0, "waves")


def assemble(items: list[RegenItem], answers: list[list[Answer]], failed: dict[int, dict], on_degenerate: str,
             generation_s: float, schedule: str) -> BatchResult:
    """A batch's records, failures and stats from its conversations' answers (`failed`: by item index)."""
    on_degenerate = OnDegenerate.parse(on_degenerate, "regen.on_degenerate")
    n_tokens = sum(a.n_tokens for turns in answers for a in turns)
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
    pending = [f for f in failed.values() if f.get("retryable")]
    for_good = [f for f in failed.values() if not f.get("retryable")]
    stats = {
        "conversations": len(items),
        "written": len(records),
        "turns": sum(len(a) for a in answers),
        "tokens": n_tokens,
        "generation_s": generation_s,
        "degenerate_turns": dict(degenerate),
        "dropped_degenerate": dropped,
        "failed": len(for_good),
        "failures_by_reason": dict(Counter(f["reason"] for f in for_good)),
        "schedule": {schedule: 1},  # batches per schedule (sums across shards)
    }
    return BatchResult(records, for_good, stats, pending)
