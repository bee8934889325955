"""Stage dump, the work itself: forward the target over the planned batches, capture the chosen layers'
inputs and the final-norm output, strip pads, and stream the rows into atomic Arrow shards.

Resumption and ranks: shard `k` of the plan is written by rank `k % world_size` (`pipeline.dist`), under a
temporary name then renamed. When a shard is complete its entry (rows, tokens, bytes, sha256) is recorded in
`.progress/shard-k.json`. A rerun skips shards recorded with the same plan key, adopts complete shards that
were renamed but not yet recorded (the plan key is in their schema metadata), and rewrites everything else.
Whichever rank records the last shard writes `manifest.json` listing every shard.

Tensor parallelism (`target.tensor_parallel=N`, pipeline.dist.TargetLayout): a group of N ranks is one dumper,
rank `g` of `world // N` in the split above; all its ranks forward the same batches and its first rank writes.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import pyarrow as pa
import torch

from pipeline.dist import RankInfo, TargetLayout, rank_info, shard_for_rank
from pipeline.files import atomic_write_text
from pipeline.hidden_states.capture import (
    CONVENTION,
    FINAL_FEATURE,
    HiddenStateCapture,
    no_autograd,
    pad_batch,
    resolve_layer_ids,
)
from pipeline.hidden_states.config import DumpConfig
from pipeline.hidden_states.plan import DumpPlan, TokenizedSample, make_plan
from pipeline.hidden_states.shards import (
    FORMAT_NAME,
    FORMAT_VERSION,
    ShardWriter,
    StateLayout,
    dtype_name,
    record_batch,
    resolve_dump_dtype,
    shard_entry,
    shard_index,
    shard_metadata,
    shard_name,
)
from pipeline.manifest import MANIFEST, write_manifest

log = logging.getLogger(__name__)

PROGRESS_DIR = ".progress"


@dataclass
class DumpSummary:
    rows: int
    tokens: int
    bytes: int
    shards: int
    raw_bytes_per_token: int
    # this rank, this run (shards skipped on resume not counted)
    tokens_written: int
    seconds: float
    manifest: Optional[Path]  # None until the last rank finishes

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / max(self.tokens, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_written / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        run = (f"this run wrote {self.tokens_written} tokens in {self.seconds:.1f} s ({self.tokens_per_s:.0f} tokens/s)"
               if self.tokens_written else "this run had nothing left to write")
        return (f"dump: {self.rows} rows, {self.tokens} tokens in {self.shards} shards, {self.bytes / 2**20:.1f} MiB "
                f"({self.bytes_per_token:.1f} B/token, raw {self.raw_bytes_per_token} B/token, "
                f"x{self.bytes_per_token / self.raw_bytes_per_token:.4f}); {run}")


def state_layout(target, cfg: DumpConfig) -> StateLayout:
    layer_ids = resolve_layer_ids(cfg.layer_ids, target.num_layers)
    return StateLayout(target.hidden_size, tuple(layer_ids), resolve_dump_dtype(cfg.dtype, target.dtype))


def plan_dump(target, samples: Sequence[TokenizedSample], cfg: DumpConfig) -> tuple[StateLayout, DumpPlan]:
    layout = state_layout(target, cfg)
    fp = target.fingerprint
    key_parts = {"format_version": FORMAT_VERSION, "layer_ids": list(layout.layer_ids),
                 "dtype": dtype_name(layout.dtype),
                 "target": {k: fp.get(k) for k in ("config_digest", "tokenizer_digest", "weights_digest")}}
    if target.precision != "float32":  # a resumed dump never mixes shards computed in two precisions
        key_parts["precision"] = target.precision  # (fp32 adds nothing: plans made before this keep their key)
    plan = make_plan(samples, cfg.batch_tokens, cfg.max_batch_size, cfg.shard_bytes, layout.row_bytes, key_parts)
    return layout, plan


def forward_batch(cap: HiddenStateCapture, rows: Sequence[TokenizedSample], device, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One padded forward -> (aux [sum(T), n_layers*H], final [sum(T), H]) on CPU in `dtype`, rows
    concatenated without their pads."""
    input_ids, attention_mask = pad_batch([r.input_ids for r in rows], device)
    aux, final = cap.forward(input_ids, attention_mask)  # [B, T, n*H], [B, T, H]
    if len(rows) == 1:
        return aux[0].to("cpu", dtype), final[0].to("cpu", dtype)
    lengths = [len(r) for r in rows]
    aux = torch.cat([aux[b, :n] for b, n in enumerate(lengths)])  # [sum(T), n*H]
    final = torch.cat([final[b, :n] for b, n in enumerate(lengths)])
    return aux.to("cpu", dtype), final.to("cpu", dtype)


def forward_only(target, samples: Sequence[TokenizedSample], batches: Sequence[Sequence[int]]) -> tuple[int, float]:
    """The same body forward over the same batches (`plan.batches`), writing nothing: the baseline of the
    dump benchmark. Returns (tokens, seconds)."""
    body = HiddenStateCapture(target.model, [0]).body
    tokens, t0 = 0, time.perf_counter()
    with no_autograd(body):
        for batch in batches:
            input_ids, attention_mask = pad_batch([samples[i].input_ids for i in batch], target.device)
            body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            tokens += sum(len(samples[i]) for i in batch)
    return tokens, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------------
# progress records


def _progress_path(out_dir: Path, index: int) -> Path:
    return out_dir / PROGRESS_DIR / f"{shard_name(index)}.json"


def _write_json_atomic(path: Path, doc: dict) -> None:
    atomic_write_text(path, json.dumps(doc, sort_keys=True))


def _recorded(out_dir: Path, k: int, plan: DumpPlan) -> Optional[dict]:
    """Shard k's entry if it is complete for this plan. A shard renamed into place but never recorded (a kill
    between the two) is adopted when its footer carries this plan key and the planned row count."""
    path, record = out_dir / shard_name(k), _progress_path(out_dir, k)
    if not path.is_file():
        return None
    if record.is_file():
        doc = json.loads(record.read_text())
        if doc.get("plan_key") == plan.key:
            # Recorded for this plan: trusted if the size still matches (dump.verify rechecks content).
            return doc["entry"] if doc["entry"]["bytes"] == path.stat().st_size else None
    try:
        meta, rows = shard_metadata(path)
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException):  # not a complete shard of ours
        return None
    if meta.get("plan_key") != plan.key or rows != plan.shard_rows[k]:
        return None
    entry = shard_entry(path)
    _write_json_atomic(record, {"plan_key": plan.key, "entry": entry})
    return entry


def _all_recorded(out_dir: Path, n_shards: int, plan_key: str) -> Optional[list[dict]]:
    """Every shard's progress record (entry + seconds spent on it), or None while any is missing."""
    docs = []
    for k in range(n_shards):
        record = _progress_path(out_dir, k)
        if not record.is_file():
            return None
        doc = json.loads(record.read_text())
        if doc.get("plan_key") != plan_key:
            return None
        docs.append(doc)
    return docs


def _remove_stale(out_dir: Path, n_shards: int) -> None:
    """Once every shard is complete: temporary files of writers that were killed, and shards beyond this
    plan's count left by an earlier run with another input or config."""
    for tmp in [*out_dir.glob(".shard-*.arrow.tmp"), *(out_dir / PROGRESS_DIR).glob(".*.tmp")]:
        tmp.unlink(missing_ok=True)
    for path in out_dir.glob("shard-*.arrow"):
        if shard_index(path.name) >= n_shards:
            path.unlink(missing_ok=True)
            _progress_path(out_dir, shard_index(path.name)).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------------


def dump_hidden_states(target, samples: Sequence[TokenizedSample], cfg: DumpConfig, out_dir: Path,
                       rank: Optional[RankInfo] = None, manifest_extra: Optional[dict] = None,
                       progress: bool = True, target_layout: Optional[TargetLayout] = None) -> DumpSummary:
    """Dump this rank's shards of the plan into `out_dir`; the rank that completes the set writes the
    manifest. `manifest_extra` is merged into the manifest (config, counts, inputs of the stage).
    `target_layout` (tensor parallelism): this rank's TP group dumps as data rank `rank // N` of `world // N`;
    every rank of the group forwards, the first writes."""
    if target_layout is None:
        rank = rank or rank_info()
        target_layout = TargetLayout(rank.rank, rank.world_size, rank.local_rank)
    rank, writes = target_layout.data, target_layout.is_writer
    out_dir = Path(out_dir)
    layout, plan = plan_dump(target, samples, cfg)
    schema = layout.schema(plan.key)
    mine = None
    if writes:
        (out_dir / PROGRESS_DIR).mkdir(parents=True, exist_ok=True)
        _invalidate_old_manifest(out_dir, plan.key)
        mine = [k for k in shard_for_rank(len(plan.shards), rank) if _recorded(out_dir, k, plan) is None]
    mine = target_layout.agree(mine)  # the writer's view of what is left: the group forwards the same batches
    if not writes:
        return _forward_shards(target, samples, plan, layout, mine)
    todo_tokens = sum(plan.shard_tokens[k] for k in mine)
    log.info("dump: %d samples, %d batches, %d shards; rank %d/%d writes %d shards (%d tokens)%s", len(samples),
             len(plan.batches), len(plan.shards), rank.rank, rank.world_size, len(mine), todo_tokens,
             "" if len(mine) == len(shard_for_rank(len(plan.shards), rank)) else " (resuming)")

    bar = _progress_bar(todo_tokens, progress and rank.is_main)
    t0 = time.perf_counter()
    with HiddenStateCapture(target.model, layout.layer_ids) as cap:
        for k in mine:
            _write_shard(cap, target, samples, plan, k, layout, schema, out_dir, bar)
    seconds = time.perf_counter() - t0
    bar.close()

    extra = {**(manifest_extra or {}), "tensor_parallel": target_layout.tp}
    manifest = _finalize(out_dir, target, layout, plan, cfg, extra,
                         {"seconds": seconds, "tokens_written": todo_tokens, "rank": rank.rank,
                          "world_size": rank.world_size})
    return DumpSummary(rows=len(samples), tokens=sum(plan.shard_tokens),
                       bytes=_total_bytes(out_dir, len(plan.shards)), shards=len(plan.shards),
                       raw_bytes_per_token=layout.raw_bytes_per_token, tokens_written=todo_tokens,
                       seconds=seconds, manifest=manifest)


def _forward_shards(target, samples, plan: DumpPlan, layout: StateLayout, shards: Sequence[int]) -> DumpSummary:
    """A tensor-parallel rank other than its group's first: the group's forwards, in its order, nothing written."""
    t0, tokens = time.perf_counter(), sum(plan.shard_tokens[k] for k in shards)
    with HiddenStateCapture(target.model, layout.layer_ids) as cap:
        for k in shards:
            for b in plan.shards[k]:
                forward_batch(cap, [samples[i] for i in plan.batches[b]], target.device, layout.dtype)
    return DumpSummary(rows=len(samples), tokens=sum(plan.shard_tokens), bytes=0, shards=len(plan.shards),
                       raw_bytes_per_token=layout.raw_bytes_per_token, tokens_written=tokens,
                       seconds=time.perf_counter() - t0, manifest=None)


def _write_shard(cap, target, samples, plan: DumpPlan, k: int, layout: StateLayout, schema, out_dir: Path, bar):
    t0 = time.perf_counter()
    writer = ShardWriter(out_dir / shard_name(k), schema)
    try:
        for b in plan.shards[k]:
            rows = [samples[i] for i in plan.batches[b]]
            aux, final = forward_batch(cap, rows, target.device, layout.dtype)
            writer.write(record_batch(schema, rows, aux, final))
            bar.update(sum(len(r) for r in rows))
    except BaseException:
        writer.abort()
        raise
    entry = writer.close()
    _write_json_atomic(_progress_path(out_dir, k),
                       {"plan_key": plan.key, "entry": entry, "seconds": time.perf_counter() - t0})


def _invalidate_old_manifest(out_dir: Path, plan_key: str) -> None:
    path = out_dir / MANIFEST
    if path.is_file():
        try:
            old_key = json.loads(path.read_text()).get("plan", {}).get("key")
        except json.JSONDecodeError:
            old_key = None
        if old_key != plan_key:
            log.warning("dump: %s was made from another input or config; replacing it", out_dir)
            path.unlink(missing_ok=True)


def _total_bytes(out_dir: Path, n_shards: int) -> int:
    return sum((out_dir / shard_name(k)).stat().st_size for k in range(n_shards) if (out_dir / shard_name(k)).exists())


def _finalize(out_dir: Path, target, layout: StateLayout, plan: DumpPlan, cfg: DumpConfig, extra: dict,
              timings: dict) -> Optional[Path]:
    docs = _all_recorded(out_dir, len(plan.shards), plan.key)
    if docs is None:
        log.info("dump: this rank is done; the manifest is written by the rank that finishes last")
        return None
    _remove_stale(out_dir, len(plan.shards))
    entries = [d["entry"] for d in docs]
    # Shards adopted after a kill have no timing; the rate covers the shards that were timed.
    timed = [d for d in docs if "seconds" in d]
    shard_seconds = sum(d["seconds"] for d in timed)
    timings = {"shard_seconds": shard_seconds,
               "tokens_per_s": sum(d["entry"]["tokens"] for d in timed) / shard_seconds if shard_seconds else None,
               "this_run": timings}
    rows, tokens, nbytes = (sum(e[f] for e in entries) for f in ("rows", "tokens", "bytes"))
    fp = target.fingerprint
    extra = dict(extra)
    config = extra.pop("config", {"dump": cfg})
    counts = {"rows": rows, "tokens": tokens, "shards": len(entries), **extra.pop("counts", {})}
    inputs = extra.pop("inputs", [])
    return write_manifest(
        out_dir, "dump", config, counts, timings, inputs=inputs,
        format={"name": FORMAT_NAME, "version": FORMAT_VERSION},
        target=fp,
        precision=target.precision,  # the compute dtype of the target's forward (`dtype` is the storage)
        tokenizer_digest=fp.get("tokenizer_digest"),
        layers={"ids": list(layout.layer_ids), "convention": CONVENTION, "final": FINAL_FEATURE,
                "num_target_layers": target.num_layers},
        hidden_size=layout.hidden_size,
        dtype=dtype_name(layout.dtype),
        plan={"key": plan.key, "batches": len(plan.batches), "batch_tokens": cfg.batch_tokens,
              "max_batch_size": cfg.max_batch_size, "shard_bytes": cfg.shard_bytes},
        shards=entries,
        totals={"rows": rows, "tokens": tokens, "bytes": nbytes, "bytes_per_token": nbytes / max(tokens, 1),
                "raw_bytes_per_token": layout.raw_bytes_per_token},
        **extra,
    )


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress_bar(total_tokens: int, enabled: bool):
    if not enabled or total_tokens == 0:
        return _NoBar()
    from tqdm.auto import tqdm
    return tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="dump", smoothing=0.1)
