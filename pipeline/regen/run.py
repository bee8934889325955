"""Stage regen: every user turn of the input answered by the target itself (see docs/design.md).

Reads the data sources, plans batches over the whole input, generates this rank's missing shards (streamed
through a server's slots, stream.py, or wave by wave in process, waves.py), and writes the manifest when it
finds every shard done, whichever rank that is. Backends are registered in backends.py; the directory's
bookkeeping is shards.py.
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Optional

from tqdm.auto import tqdm

from pipeline.data.bad_records import BadRecordReport
from pipeline.data.chat import ThinkingMode
from pipeline.dist import RankInfo, rank_info, shard_for_rank
from pipeline.lock import first_writer_lock
from pipeline.manifest import FINGERPRINT_KEYS, write_manifest
from pipeline.regen import answer_store, backends
from pipeline.regen.batching import Plan, RegenItem, make_plan, read_items
from pipeline.regen.config import RegenConfig
from pipeline.regen.shards import RegenDir, RegenStateError, sum_stats
from pipeline.regen.stream import FailureWindow, stream_rank
from pipeline.regen.waves import BatchResult, regen_batch

log = logging.getLogger(__name__)


def main(cfg) -> Optional[dict]:
    """Returns the run summary on rank 0 (None on other ranks). `cfg` is the root config (pipeline.config, the
    entry point's): regen reads its `regen`, `data` and `target` sections and its stage folders."""
    rcfg = cfg.regen
    _check(rcfg)
    info = rank_info()
    t0 = time.time()
    report = BadRecordReport()
    items = read_items(cfg, report)
    if report.total:
        log.warning("%s", report.summary())
    if not items:
        raise ValueError("regen: the data sources hold no usable conversation")

    backend, fingerprint, generation = make_backend(cfg, info)
    try:  # a managed llama.cpp server is stopped however the run ends (and dies with this process)
        return _run(cfg, info, items, report, backend, fingerprint, generation, t0)
    finally:
        if backend is not None and hasattr(backend, "close"):
            backend.close()


def _run(cfg, info: RankInfo, items: list[RegenItem], report: BadRecordReport, backend,
         fingerprint: dict, generation: dict, t0: float) -> Optional[dict]:
    rcfg = cfg.regen
    plan = make_plan(items, rcfg.batch_size, rcfg.batches_per_shard, prompt_length(backend))
    out = RegenDir(cfg.stage_dir("regen"))
    identity = {"plan": plan.digest, "conversations": len(items), "batches": plan.n_batches,
                # fp32 is left out so runs started before precision was recorded still resume.
                "generation": {k: v for k, v in generation.items()
                               if k not in ("base_url", "server") and not (k == "precision" and v == "float32")},
                "target": {k: fingerprint.get(k) for k in FINGERPRINT_KEYS}}
    resumed = out.claim(identity, rcfg.overwrite, single_rank=info.world_size == 1)
    if info.world_size == 1:
        out.remove_stale_tmp()
    if rcfg.answer_store:
        resumed |= answer_store.restore(out, identity, plan, items, Path(rcfg.answer_store),
                                        shards=shard_for_rank(plan.n_shards, info)) > 0
        try:
            return _run_claimed(cfg, info, items, report, backend, fingerprint, generation, t0, plan, out, resumed)
        finally:  # a stopped, failing or finished run leaves the store as far as the folder got
            answer_store.save(out.root, Path(rcfg.answer_store))
    return _run_claimed(cfg, info, items, report, backend, fingerprint, generation, t0, plan, out, resumed)


def _run_claimed(cfg, info: RankInfo, items: list[RegenItem], report: BadRecordReport, backend, fingerprint: dict,
                 generation: dict, t0: float, plan: Plan, out: RegenDir, resumed: bool) -> Optional[dict]:
    rcfg = cfg.regen
    log.info("regen rank %d/%d (%s): %d conversations, %d batches, %d shards -> %s%s", info.rank, info.world_size,
             generation["backend"], len(items), plan.n_batches, plan.n_shards, out.root,
             " (resuming)" if resumed else "")
    if plan.n_shards < info.world_size:
        log.warning("only %d shards for %d ranks: lower regen.batches_per_shard or batch_size to use them all",
                    plan.n_shards, info.world_size)

    if rcfg.finalize_partial:
        return finalize_partial(cfg, out, report, fingerprint, generation, plan, t0) if info.is_main else None
    if 0 < rcfg.batch_size < getattr(backend, "concurrency", 0):
        log.warning("regen.batch_size=%d < %d conversations in flight: a batch cannot fill the server's slots; "
                    "raise regen.batch_size (several times the slots keeps them full)", rcfg.batch_size,
                    backend.concurrency)
    fresh, pending = run_rank(out, plan, items, backend, rcfg, info)
    log.info("regen rank %d, this run: %s", info.rank, describe(fresh))
    if pending:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(Counter(f["reason"] for f in pending).items()))
        raise RegenPending(f"{len(pending)} conversations of rank {info.rank} are still pending after failed "
                           f"requests ({reasons}; e.g. {pending[0]['id']}: {str(pending[0]['detail'])[:200]}). "
                           f"Everything finished is kept: rerun the same command, it asks exactly those")
    return finalize(cfg, out, report, fingerprint, generation, plan, t0, info, server_rss_mb(backend))


def server_rss_mb(backend) -> Optional[float]:
    """Peak RSS of the server a backend started for this run (its process tree), if it started one."""
    server = getattr(backend, "server", None)
    return server.peak_rss_mb() if server is not None and hasattr(server, "peak_rss_mb") else None


def finalize(cfg, out: RegenDir, report: BadRecordReport, fingerprint: dict, generation: dict,
             plan: Plan, t0: float, info: RankInfo, server_rss: Optional[float] = None) -> Optional[dict]:
    """The manifest, written by whichever rank finds every shard done (the last to finish, or a rerun), so no
    rank waits for the others. Idempotent: under a lock, a rank that finds it written already leaves it."""
    markers = out.markers(plan.n_shards)
    missing = sum(m is None for m in markers)
    if missing:
        log.info("regen rank %d: its shards are done; %d of %d shards are other ranks' still: the last rank to "
                 "finish writes the manifest (or a rerun of regen, with any number of ranks)", info.rank, missing,
                 plan.n_shards)
        return None
    with first_writer_lock(out.root / "manifest.json"):
        if out.manifest_written(plan.digest, markers):  # by another rank, or an earlier run: left as it is
            log.info("regen rank %d: every shard is done and %s is written", info.rank, out.root / "manifest.json")
            return sum_stats([m["stats"] for m in markers])
        summary = write_regen_manifest(cfg, out, markers, report, fingerprint, generation, plan, time.time() - t0,
                                       server_rss)
    log.info("regen done: %s", describe(summary))
    return summary


class RegenPending(RuntimeError):
    """Conversations whose requests failed transiently: not done, asked again by a rerun."""


def finalize_partial(cfg, out: RegenDir, report: BadRecordReport, fingerprint: dict,
                     generation: dict, plan: Plan, t0: float) -> dict:
    markers = [m for m in out.markers(plan.n_shards) if m is not None]
    if not markers:
        raise ValueError(f"regen.finalize_partial: no finished shard in {out.root} yet")
    summary = write_regen_manifest(cfg, out, markers, report, fingerprint, generation, plan, time.time() - t0)
    log.warning("regen manifest written over %d of %d shards (%d planned conversations not regenerated); rerun "
                "without regen.finalize_partial to finish them", len(markers), plan.n_shards,
                plan.n_items - summary.get("conversations", 0))
    return summary


def _check(rcfg: RegenConfig) -> None:
    if rcfg.temperature < 0 or not 0 < rcfg.top_p <= 1:
        raise ValueError(f"regen.temperature must be >= 0 and 0 < top_p <= 1 (got {rcfg.temperature}, {rcfg.top_p})")


def prompt_length(backend):
    """The backend's prompt measure for planning; characters without a backend (finalize_partial through a
    server: the plan must equal the run's, and server backends measure characters)."""
    return backend.prompt_length if backend is not None else RegenItem.prompt_chars


def resolve_backend(cfg) -> str:
    """`auto`: the first backend of `backends.AUTO_ORDER` for the target's device that can serve it here (the
    llama.cpp server for a GGUF target on CPU once its binary is built, else in-process HF generation)."""
    rcfg = cfg.regen
    if rcfg.backend != "auto":
        return str(rcfg.backend)
    from pipeline.target import resolve_device

    started = RegenDir(cfg.stage_dir("regen")).run_path
    if started.is_file() and not rcfg.overwrite:  # a run being resumed keeps the engine it started with
        previous = json.loads(started.read_text()).get("generation", {}).get("backend")
        if previous in backends.names() and previous != "openai":
            return previous
    # An answer store restores only what its own engine answered: `auto` keeps that engine, and says so where it
    # cannot run here, rather than answer with another one and have the store refuse every stored conversation.
    stored = answer_store.stored_backend(Path(rcfg.answer_store)) if rcfg.answer_store else None
    if stored in backends.names() and stored != "openai":
        reason = backends.module(stored).unavailable(cfg)
        if reason is None:
            return stored
        raise RegenStateError(f"regen.backend=auto: the answers in regen.answer_store={rcfg.answer_store} came from "
                              f"the {stored} backend, which cannot run here ({reason}); make it available, or name "
                              f"regen.backend and another regen.answer_store to answer them afresh")
    for name in backends.AUTO_ORDER.get(resolve_device(cfg.target.device).type, ("hf",)):
        reason = backends.module(name).unavailable(cfg)
        if reason is None:
            return name
        log.debug("regen.backend=auto: not %s (%s)", name, reason)
    return "hf"


def make_backend(cfg, info: RankInfo):
    """(backend, target fingerprint, generation parameters) of the resolved backend (pipeline/regen/backends.py)."""
    rcfg = cfg.regen
    name = resolve_backend(cfg)
    generation = {"backend": name, "max_new_tokens": rcfg.max_new_tokens, "temperature": rcfg.temperature,
                  "top_p": rcfg.top_p, "seed": rcfg.seed, "batch_size": rcfg.batch_size,
                  "batches_per_shard": rcfg.batches_per_shard, "on_degenerate": rcfg.on_degenerate,
                  "system_prompt": cfg.data.system_prompt}
    if rcfg.thinking != ThinkingMode.template:  # recorded only when set, so runs started before the switch resume
        generation["thinking"] = rcfg.thinking
    backend, fingerprint, specific = backends.module(name).make(cfg, info)
    generation.update(specific)
    return backend, fingerprint, generation


def run_rank(out: RegenDir, plan: Plan, items: list[RegenItem], backend, rcfg: RegenConfig, info: RankInfo
             ) -> tuple[dict, list[dict]]:
    """Generates this rank's unfinished shards: (stats of what it generated now, pending failures)."""
    shards = list(shard_for_rank(plan.n_shards, info))
    todo = []
    for s in shards:
        if out.shard_done(s):
            out.drop_batches(plan.shard_batches(s))  # left over by a kill right after the done-marker
        else:
            todo.append(s)
    fresh: list[dict] = []
    window = FailureWindow(rcfg.max_failure_rate, rcfg.failure_window)
    bar = tqdm(total=sum(plan.shard_size(s) for s in todo), unit="conv", desc=f"regen r{info.rank}",
               disable=not rcfg.progress, mininterval=2.0, dynamic_ncols=True)

    def saved(result: BatchResult) -> None:
        fresh.append(result.stats)
        done = sum_stats(fresh)
        bar.set_postfix(tok_s=f"{done['tokens'] / max(done['generation_s'], 1e-9):.0f}", tokens=done["tokens"],
                        refresh=False)

    with bar:
        if getattr(backend, "concurrency", 0) > 0:  # a server: conversations stream across batches
            pending = stream_rank(out, plan, items, todo, info.rank, backend, rcfg.seed, rcfg.on_degenerate,
                                  window, on_answer=bar.update, on_saved=saved)
            return sum_stats(fresh), pending
        pending = []
        for s in todo:  # one padded batch per wave, batch after batch
            results = []
            for b in plan.shard_batches(s):
                result = out.load_batch(b)
                if result is None:  # the journal holds only what an answer store restored
                    batch_items = [items[i] for i in plan.batches[b]]
                    result = regen_batch(backend, batch_items, rcfg.seed, rcfg.on_degenerate,
                                         journal=out.journal(b, batch_items))
                    for failure in result.failures + result.pending:
                        window.add(failure)
                    for _ in range(len(plan.batches[b]) - len(result.failures) - len(result.pending)):
                        window.add(None)
                    window.check()
                    if result.pending:
                        pending.extend(result.pending)
                        continue
                    out.save_batch(b, result)
                    saved(result)
                results.append(result)
                bar.update(len(plan.batches[b]))
            if len(results) == len(plan.shard_batches(s)):
                out.finish_shard(s, plan.shard_batches(s), results, info.rank)
    return sum_stats(fresh), pending


def describe(stats: dict) -> str:
    if not stats:
        return "nothing to generate (all shards already done)"
    tok_s = stats.get("tokens", 0) / max(stats.get("generation_s", 0.0), 1e-9)
    degenerate = ", ".join(f"{k} {v}" for k, v in sorted(stats.get("degenerate_turns", {}).items())) or "none"
    failures = ", ".join(f"{k} {v}" for k, v in sorted(stats.get("failures_by_reason", {}).items())) or "none"
    restored = (f", {stats['restored']} restored from the answer store ({stats.get('restored_tokens', 0)} tokens)"
                if stats.get("restored") else "")
    return (f"{stats.get('conversations', 0)} conversations ({stats.get('written', 0)} written{restored}), "
            f"{stats.get('turns', 0)} turns, {stats.get('tokens', 0)} tokens generated in "
            f"{stats.get('generation_s', 0.0):.1f} s = {tok_s:.1f} tok/s; degenerate turns: {degenerate} "
            f"({stats.get('dropped_degenerate', 0)} conversations dropped); failed conversations: "
            f"{stats.get('failed', 0)} ({failures})")


def write_regen_manifest(cfg, out: RegenDir, markers: list[dict], report: BadRecordReport,
                         fingerprint: dict, generation: dict, plan: Plan, wall_s: float,
                         server_rss: Optional[float] = None) -> dict:
    total = sum_stats([m["stats"] for m in markers])
    counts = {
        "conversations_in": total.get("conversations", 0),
        "conversations": total.get("written", 0),
        "turns": total.get("turns", 0),
        "tokens_generated": total.get("tokens", 0),
        # Conversations whose answers came from regen.answer_store, generated by a run of another plan, and their
        # answer tokens (not in tokens_generated): the written conversations are both kinds together.
        "conversations_restored": total.get("restored", 0),
        "tokens_restored": total.get("restored_tokens", 0),
        "degenerate_turns": total.get("degenerate_turns", {}),
        "dropped_degenerate": total.get("dropped_degenerate", 0),
        "failed_conversations": total.get("failed", 0),
        "failures_by_reason": total.get("failures_by_reason", {}),
        "bad_records": report.total,
    }
    gen_s = total.get("generation_s", 0.0)
    timings = {"wall_s": round(wall_s, 3), "generation_s": round(gen_s, 3),
               "tokens_per_s": round(total.get("tokens", 0) / gen_s, 2) if gen_s else None}
    if server_rss is not None:  # this process's own peak RSS is added by write_manifest
        timings["server_peak_rss_mb"] = round(server_rss, 1)
    write_manifest(
        out.root, "regen", {"regen": cfg.regen, "data": cfg.data, "target": cfg.target}, counts, timings,
        target=fingerprint, generation=generation, format="sharegpt",
        plan={"digest": plan.digest, "batches": plan.n_batches, "shards": plan.n_shards,
              "conversations": plan.n_items},
        complete=len(markers) == plan.n_shards, shards_missing=plan.n_shards - len(markers),
        shards=[{"path": m["path"], "conversations": m["conversations"], "sha256": m["sha256"], "rank": m["rank"]}
                for m in markers],
        errors=[{"path": m["errors"], "failures": m["stats"].get("failed", 0)} for m in markers if m["errors"]],
        bad_records=report.to_dict())
    return total
