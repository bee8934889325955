"""A rank's conversations streamed through a concurrent backend (a server with parallel slots), across batches.

Every conversation of every unfinished batch is queued at once, in plan order (within a batch, longest
first), onto `backend.concurrency` workers. Each asks its conversation's turns one after the other, the next
as soon as the previous answer returns (waves.answer_conversation), so the server's slots stay full: no turn
waits for a wave's or a batch's slowest conversation. A batch is saved once its last conversation is
answered, and a shard is finished once its last batch is saved, as with one batch at a time (shards.py), so
resumption and the records are the same (each conversation's requests do not depend on the schedule).

Finished conversations are journaled as they finish. A conversation whose request still fails after the
backend's retries is pending when the failure is transient (its batch is not saved; a rerun asks exactly the
pending conversations), or failed for good (reported in the shard's errors). `FailureWindow` stops the run,
with everything finished kept, when too many of the latest conversations failed.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Optional

from pipeline.regen.batching import Plan, RegenItem
from pipeline.regen.shards import ConversationJournal, RegenDir
from pipeline.regen.waves import Answer, BatchResult, answer_conversation, assemble

log = logging.getLogger(__name__)


class RegenFailing(RuntimeError):
    """Too many conversations failed lately (a server down): the run stops, keeping what it finished."""


class FailureWindow:
    """Outcomes of the last `size` conversations; trips when more than `max_rate` x `size` of them failed
    (so the first conversations of a run already count against a full window: an outage trips it early)."""

    def __init__(self, max_rate: float, size: int):
        self.max_rate, self.size = max_rate, max(1, size)
        self.outcomes: deque[bool] = deque(maxlen=self.size)
        self.last: Optional[dict] = None

    def add(self, failure: Optional[dict]) -> None:
        self.outcomes.append(failure is not None)
        if failure is not None:
            self.last = failure

    def check(self) -> None:
        failed = sum(self.outcomes)
        if failed > self.max_rate * self.size:
            last = self.last or {}
            raise RegenFailing(
                f"{failed} of the last {len(self.outcomes)} conversations failed (more than regen.max_failure_rate="
                f"{self.max_rate:g} of regen.failure_window={self.size}); last: {last.get('reason')} "
                f"({str(last.get('detail', ''))[:200]}). Everything finished is kept: fix the cause and rerun, "
                f"it asks only what is missing")


@dataclass
class _Batch:
    index: int
    shard: int
    items: list[RegenItem]
    journal: ConversationJournal
    answers: dict[int, list[Answer]] = field(default_factory=dict)
    failed: dict[int, dict] = field(default_factory=dict)
    spent_s: float = 0.0  # generation seconds of earlier runs (journal)
    left: int = 0  # conversations not answered yet


def stream_rank(out: RegenDir, plan: Plan, items: list[RegenItem], shards: list[int], rank: int, backend,
                seed: int, on_degenerate: str, window: FailureWindow, on_answer: Callable[[int], None] = lambda n: None,
                on_saved: Callable[[BatchResult], None] = lambda r: None) -> list[dict]:
    """Generates the unfinished batches of `shards` and finishes every shard whose batches are all saved.
    Returns the failures of conversations left pending (empty when every shard is done)."""
    results: dict[int, dict[int, BatchResult]] = {s: {} for s in shards}
    batches: list[_Batch] = []
    for s in shards:
        for b in plan.shard_batches(s):
            saved = out.load_batch(b)
            if saved is not None:
                results[s][b] = saved
                continue
            batch_items = [items[i] for i in plan.batches[b]]
            batch = _Batch(b, s, batch_items, out.journal(b, batch_items))
            finished, batch.spent_s = batch.journal.load()
            batch.answers = {i: finished[it.id] for i, it in enumerate(batch_items) if it.id in finished}
            batch.left = len(batch_items) - len(batch.answers)
            batches.append(batch)

    t0 = time.perf_counter()
    last_saved = [t0]  # generation time is attributed to batches as they complete: the sum is the wall time
    pending: list[dict] = []

    def complete(batch: _Batch) -> None:
        answers = [batch.answers.get(i, []) for i in range(len(batch.items))]
        now = time.perf_counter()
        result = assemble(batch.items, answers, batch.failed, on_degenerate,
                          batch.spent_s + now - last_saved[0], "conversation")
        last_saved[0] = now
        if result.pending:  # not saved: the journal keeps the finished ones, a rerun asks the pending ones
            pending.extend(result.pending)
            return
        out.save_batch(batch.index, result)
        on_saved(result)
        results[batch.shard][batch.index] = result
        if len(results[batch.shard]) == len(plan.shard_batches(batch.shard)):
            out.finish_shard(batch.shard, plan.shard_batches(batch.shard),
                             [results[batch.shard][b] for b in plan.shard_batches(batch.shard)], rank)

    for s in shards:  # shards whose batches were all saved before a kill
        if len(results[s]) == len(plan.shard_batches(s)):
            out.finish_shard(s, plan.shard_batches(s), [results[s][b] for b in plan.shard_batches(s)], rank)
    for batch in [b for b in batches if b.left == 0]:  # every conversation journaled
        complete(batch)

    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=backend.concurrency, thread_name_prefix="regen-conv")
    futures = {}
    try:
        for batch in batches:
            if batch.left == 0:
                continue
            clock = (lambda spent: lambda: spent + time.perf_counter() - t0)(batch.spent_s)
            order = sorted((i for i in range(len(batch.items)) if i not in batch.answers),
                           key=lambda i: -len(batch.items[i].user_turns))
            for i in order:
                future = pool.submit(answer_conversation, backend, batch.items[i], seed, stop, batch.journal, clock)
                futures[future] = (batch, i)
        waiting = set(futures)
        while waiting:
            done, waiting = wait(waiting, return_when=FIRST_COMPLETED)
            for future in done:
                batch, i = futures[future]
                answers, failure = future.result()  # a dead server of our own or an interrupt raises
                window.add(failure)
                if failure is None:
                    batch.answers[i] = answers
                else:
                    batch.failed[i] = failure
                    log.log(logging.WARNING if failure.get("retryable") else logging.INFO,
                            "conversation %s, turn %d: %s (%s) after %d attempts%s", failure["id"], failure["turn"],
                            failure["reason"], str(failure["detail"])[:200], failure["attempts"],
                            ": pending, a rerun asks it again" if failure.get("retryable") else "")
                on_answer(1)
                batch.left -= 1
                if batch.left == 0:
                    complete(batch)
            window.check()
    except BaseException:
        # A failing run, a dead server or an interrupt: no conversation asks another turn, and the caller can
        # stop a server at once instead of waiting for every conversation to finish its turns.
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return pending
