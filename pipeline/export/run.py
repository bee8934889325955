"""Stage export: `python -m pipeline.run stage=export experiment=<name> [export.format=sglang|vllm|eagle1|gguf]
[export.dtype=float32] [export.verify=true]`.

Reads the train stage's final head (`outputs/<exp>/train/<head>/`), writes `outputs/<exp>/export/<head>/<format>/`
(config.json, model.safetensors, manifest.json) and prints the commands that serve it. Formats: docs/export.md."""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from pipeline.heads.io import load_head
from pipeline.manifest import file_digests, load_manifest, write_manifest
from pipeline.precision import resolve_dtype
from pipeline.target import load_target_parts, resolve_source

from .exporter import (
    CONFIG,
    WEIGHTS,
    check_export,
    export_head,
    load_export,
    max_logit_diff,
    model_architectures,
    tensor_table,
)
from .formats import DTYPE_NAMES, ExportContext, ExportError, format_for_head

log = logging.getLogger(__name__)
SERVE_PATH = "EXPORT_DIR"  # the export folder in the manifest's serve commands


def main(cfg) -> Path:
    t0 = time.perf_counter()
    ecfg = cfg.export
    train_dir, export_root = cfg.stage_dir("train"), cfg.stage_dir("export")
    # Settings first: fail before loading anything. A storage dtype, so no device's speed enters.
    dtype = resolve_dtype(str(ecfg.dtype), torch.device("cpu"), "export.dtype", choices=DTYPE_NAMES.values())
    load_manifest(train_dir, expect_stage="train")
    target = load_target_parts(cfg.target)  # the embedding and lm_head a head copies, not the model
    # fp32 whatever the target's dtype: the export casts once, from the trained weights.
    head = load_head(train_dir, target, device=torch.device("cpu"), dtype=torch.float32)
    form = format_for_head(ecfg.format, head.config.kind)
    kind, location = resolve_source(cfg.target)
    ctx = ExportContext(target.num_layers, verifier_name(cfg), tuple(model_architectures(target.model)),
                        ecfg.speculative_tokens, str(ecfg.sglang.aux_convention),
                        cfg.tree.fixed("export's serve command"), target_dir=str(target.source),
                        target_gguf=str(location) if kind == "gguf" else None)
    out = export_head(head, export_root / form.name, form.name, dtype, num_target_layers=ctx.num_target_layers,
                      verifier=ctx.verifier, verifier_architectures=ctx.verifier_architectures,
                      speculative_tokens=ctx.speculative_tokens, sglang_aux_convention=ctx.sglang_aux_convention,
                      tree=ctx.tree, target_dir=ctx.target_dir, target_gguf=ctx.target_gguf)
    infos = check_export(out)
    counts = {"tensors": len(infos),
              "parameters": sum(math.prod(t.shape) for t in infos if t.name not in ("d2t", "t2d"))}
    if ecfg.verify:
        print(tensor_table(infos))
        loaded = load_export(out, target.model, device=torch.device("cpu"), dtype=torch.float32,
                             sglang_aux_convention=ecfg.sglang.aux_convention)
        counts["max_logit_diff"] = max_logit_diff(head, loaded)
        print(f"round trip ({DTYPE_NAMES[dtype]}): max |logits(export) - logits(checkpoint)| = "
              f"{counts['max_logit_diff']:.3g}")
    form.warn(head.config.aux_layer_ids, ctx)
    if head.config.fc_norm or head.config.norm_output:
        # Loaders that predate EAGLE-3.1 skip tensors they do not know and ignore the two keys: such a server
        # loads this head without complaint and drafts with it as a plain EAGLE-3, at a much lower tau.
        log.warning("EAGLE-3.1 head (fc_norm=%s, norm_output=%s): serve it with a framework whose llama_eagle3 "
                    "reads `fc_norm` and `norm_output` (docs/export.md); older ones load it silently as EAGLE-3",
                    head.config.fc_norm, head.config.norm_output)
    write_manifest(out, "export", config={"export": ecfg, "head": cfg.head, "target": cfg.target},
                   counts=counts, timings={"total_s": time.perf_counter() - t0}, inputs=[train_dir],
                   target=target.fingerprint, format=form.name, head_config=head.config.to_dict(),
                   files=file_digests(out, [CONFIG, WEIGHTS, *form.extra_files]),
                   # With the folder as a placeholder: a copy of the export (a model card) names its own.
                   serve_commands=form.serve_commands(SERVE_PATH, head.config.aux_layer_ids, ctx))
    path = str(Path(out).resolve())
    print("\n".join([f"export ({form.name}, {ecfg.dtype}): {path}",
                     *form.serve_commands(path, head.config.aux_layer_ids, ctx)]))
    return out


def verifier_name(cfg) -> str:
    """The target as the serving machine names it: export.verifier, else target.hub_id, else the path the user
    gave (never eaglet's local dequantization cache)."""
    name = cfg.export.verifier or cfg.target.hub_id or cfg.target.path
    if not name:
        raise ExportError("cannot name the target for serving: set export.verifier or target.hub_id")
    return name
