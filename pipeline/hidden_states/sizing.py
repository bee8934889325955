"""Sizing before anything runs (`stage=dump dump.plan_only=true`): tokens, bytes on disk per precision, shard count
and the estimated accelerator memory per rank for a tensor-parallel layout, from the target's config and the
tokenized input alone (no weights are read).

Disk is exact arithmetic of the shard format (shards.py): every token stores its captured layers plus the final
state, `(len(layer_ids) + 1) x hidden_size` values, and a 4-byte id and 1-byte mask. Memory is an estimate with
its terms shown (weights / TP, one layer's working set of a forward batch, the captured states; for training the
head's fp32 master weights, gradients and Adam moments): it tells a 2 x 8 H100 plan from an impossible one, it is
not an allocator trace.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

GIB = 1024 ** 3
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
ADAM_BYTES_PER_PARAM = 16  # fp32 master weight + gradient + two Adam moments


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def target_parameters(hf_config) -> int:
    """The target's parameter count from its config (a meta-device skeleton: no memory, exact)."""
    from pipeline.target import skeleton

    return count_parameters(skeleton(hf_config))


def head_parameters(hf_config, kind: str, layer_ids: Sequence[int], draft_vocab_size: Optional[int]) -> int:
    """The trainable head's parameter count (its frozen embedding copy excluded), built on the meta device."""
    from pipeline.heads import DraftHeadConfig, build_draft_head, head_spec

    aux = list(layer_ids) if head_spec(kind).fuses_target_layers else None
    vocab = None if head_spec(kind).full_vocab else min(draft_vocab_size or hf_config.vocab_size, hf_config.vocab_size)
    config = DraftHeadConfig.from_target(hf_config, kind, draft_vocab_size=vocab, aux_layer_ids=aux)
    with torch.device("meta"):
        head = build_draft_head(config)
    frozen = sum(p.numel() for n, p in head.named_parameters() if n.startswith("embed_tokens"))
    return count_parameters(head) - frozen


def disk(tokens: int, hidden_size: int, n_layers: int, shard_bytes: int) -> dict:
    """Bytes on disk per storage precision: total, per token, shards at `shard_bytes`."""
    out = {}
    for name in ("bfloat16", "float32"):
        per_token = (n_layers + 1) * hidden_size * ITEMSIZE[name] + 5
        total = tokens * per_token
        out[name] = {"bytes_per_token": per_token, "bytes": total, "shards": max(1, math.ceil(total / shard_bytes))}
    out["float16"] = dict(out["bfloat16"])
    return out


def memory_per_rank(hf_config, tensor_parallel: int, compute: str, batch_tokens: int, n_layers: int,
                    head_params: int, micro_batch_tokens: int) -> dict:
    """Estimated accelerator memory of one rank (GiB), by term, for the stages that run the target (dump, online
    training, eval) and for offline training (the target's parts only)."""
    item = ITEMSIZE[compute]
    h, i = hf_config.hidden_size, getattr(hf_config, "intermediate_size", 4 * hf_config.hidden_size)
    v = hf_config.vocab_size
    weights = target_parameters(hf_config) * item / tensor_parallel
    # One decoder layer's transient tensors for a forward batch: the residual stream and norms (replicated),
    # the attention projections and MLP intermediate (sharded), in the compute dtype.
    working = batch_tokens * (4 * h + 3 * i / tensor_parallel) * item
    captured = batch_tokens * (n_layers + 1) * h * item
    head = head_params * ADAM_BYTES_PER_PARAM
    # The head's activations per micro-batch: a handful of [T, H] states per TTT round plus the draft logits;
    # eaglet's TTT loss runs round by round, so a few rounds' worth is live at once.
    head_act = micro_batch_tokens * (16 * h + 2 * v) * 4
    parts = 2 * v * h * 4  # embedding + lm_head, fp32 (offline training reads only these)
    dump = weights + working + captured
    gib = lambda x: round(x / GIB, 2)  # noqa: E731
    return {"tensor_parallel": tensor_parallel, "compute_dtype": compute,
            "target_weights_gib": gib(weights), "forward_working_set_gib": gib(working + captured),
            "dump_gib": gib(dump), "online_training_gib": gib(dump + head + head_act),
            "offline_training_gib": gib(parts + head + head_act), "head_parameters": head_params}


def size_plan(hf_config, tokens: int, rows: int, layer_ids: Sequence[int], shard_bytes: int, batch_tokens: int,
              tensor_parallel: int, world_size: int, compute: str, head_kind: str = "eagle3",
              draft_vocab_size: Optional[int] = 32000, micro_batch_tokens: int = 8192,
              planned_shards: Optional[int] = None) -> dict:
    """Everything `dump.plan_only` prints, as a JSON-able dict. `planned_shards`: the real plan's shard count for
    the configured dump dtype (the per-precision counts are the same arithmetic without batch boundaries)."""
    n_layers = len(layer_ids)
    head = head_parameters(hf_config, head_kind, layer_ids, draft_vocab_size)
    layouts = sorted({1, 2, 4, 8, tensor_parallel})
    return {
        "rows": rows, "tokens": tokens, "layer_ids": list(layer_ids), "hidden_size": hf_config.hidden_size,
        "target_parameters": target_parameters(hf_config), "shard_bytes": shard_bytes,
        "planned_shards": planned_shards, "disk": disk(tokens, hf_config.hidden_size, n_layers, shard_bytes),
        "layout": {"world_size": world_size, "tensor_parallel": tensor_parallel,
                   "data_parallel": max(1, world_size // tensor_parallel)},
        "memory_per_rank": memory_per_rank(hf_config, tensor_parallel, compute, batch_tokens, n_layers, head,
                                           micro_batch_tokens),
        "memory_by_tensor_parallel": [memory_per_rank(hf_config, tp, compute, batch_tokens, n_layers, head,
                                                      micro_batch_tokens) for tp in layouts],
    }


def format_plan(plan: dict) -> str:
    """The plan as a person reads it."""
    tb = lambda b: f"{b / 1e12:.2f} TB" if b >= 1e12 else f"{b / 1e9:.2f} GB"  # noqa: E731
    lay = plan["layout"]
    lines = [f"dump plan: {plan['rows']:,} rows, {plan['tokens']:,} tokens, layers {plan['layer_ids']} + final, "
             f"hidden {plan['hidden_size']}, target {plan['target_parameters'] / 1e9:.2f}B parameters",
             f"layout: world {lay['world_size']} = tensor_parallel {lay['tensor_parallel']} x data_parallel "
             f"{lay['data_parallel']}",
             "disk (shards at {:,} bytes):".format(plan["shard_bytes"])]
    for name in ("bfloat16", "float32"):
        d = plan["disk"][name]
        lines.append(f"  {name:9s} {d['bytes_per_token']:>8,} B/token  {tb(d['bytes']):>10s}  {d['shards']:,} shards")
    if plan.get("planned_shards") is not None:
        lines.append(f"  this dump's plan (dump.dtype): {plan['planned_shards']:,} shards")
    lines.append("estimated memory per rank (GiB):")
    lines.append(f"  {'TP':>4s} {'weights':>8s} {'dump':>8s} {'online train':>13s} {'offline train':>14s}")
    for m in plan["memory_by_tensor_parallel"]:
        mark = "  <- target.tensor_parallel" if m["tensor_parallel"] == lay["tensor_parallel"] else ""
        lines.append(f"  {m['tensor_parallel']:>4d} {m['target_weights_gib']:>8.1f} {m['dump_gib']:>8.1f} "
                     f"{m['online_training_gib']:>13.1f} {m['offline_training_gib']:>14.1f}{mark}")
    return "\n".join(lines)
