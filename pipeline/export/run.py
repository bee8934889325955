"""Stage export: `python -m pipeline.run stage=export experiment=<name> [export.format=sglang|vllm|eagle1]
[export.dtype=float32] [export.verify=true]`.

Reads the train stage's final head (`outputs/<exp>/train/<head>/`), writes `outputs/<exp>/export/<head>/<format>/`
(config.json, model.safetensors, manifest.json) and prints the commands that serve it. Formats: docs/export.md."""
from __future__ import annotations

import json
import logging
import math
import shlex
import time
from pathlib import Path

import torch

from pipeline.manifest import load_manifest, write_manifest
from pipeline.target import load_target
from pipeline.train.checkpoint import load_head

from . import formats as F
from .exporter import (check_export, export_head, load_export, max_logit_diff, model_architectures,
                       tensor_table)

log = logging.getLogger(__name__)


def main(cfg) -> Path:
    t0 = time.perf_counter()
    ecfg = cfg.export
    train_dir, export_root = cfg.stage_dir("train"), cfg.stage_dir("export")
    dtype = F.resolve_dtype(ecfg.dtype)  # settings first: fail before loading anything
    F.check_convention(ecfg.sglang_aux_convention)
    load_manifest(train_dir, expect_stage="train")
    target = load_target(cfg.target)
    # fp32 whatever the target's dtype: the export casts once, from the trained weights.
    head = load_head(train_dir, target, device=torch.device("cpu"), dtype=torch.float32)
    fmt = F.resolve_format(ecfg.format, head.config.kind)
    num_layers = target.num_layers
    verifier = verifier_name(cfg)
    out = export_head(head, export_root / fmt, fmt, dtype, num_target_layers=num_layers, verifier=verifier,
                      verifier_architectures=model_architectures(target.model),
                      speculative_tokens=ecfg.speculative_tokens, sglang_aux_convention=ecfg.sglang_aux_convention)
    infos = check_export(out)
    counts = {"tensors": len(infos), "parameters": sum(math.prod(t.shape) for t in infos if t.name not in ("d2t", "t2d"))}
    if ecfg.verify:
        print(tensor_table(infos))
        loaded = load_export(out, target.model, device=torch.device("cpu"), dtype=torch.float32,
                             sglang_aux_convention=ecfg.sglang_aux_convention)
        counts["max_logit_diff"] = max_logit_diff(head, loaded)
        print(f"round trip ({F.DTYPE_NAMES[dtype]}): max |logits(export) - logits(checkpoint)| = "
              f"{counts['max_logit_diff']:.3g}")
    warn_on_sglang_numbering(head.config.aux_layer_ids, num_layers, fmt, ecfg.sglang_aux_convention)
    write_manifest(out, "export", config={"export": ecfg, "head": cfg.head, "target": cfg.target},
                   counts=counts, timings={"total_s": time.perf_counter() - t0}, inputs=[train_dir],
                   target=target.fingerprint, format=fmt, head_config=head.config.to_dict())
    print(serve_instructions(out, fmt, verifier, head.config.aux_layer_ids, num_layers, cfg))
    return out


def verifier_name(cfg) -> str:
    """The target as the serving machine names it: export.verifier, else target.hub_id, else the path the user
    gave (never eaglet's local dequantization cache)."""
    name = cfg.export.verifier or cfg.target.hub_id or cfg.target.path
    if not name:
        raise F.ExportError("cannot name the target for serving: set export.verifier or target.hub_id")
    return name


def warn_on_sglang_numbering(layer_ids, num_layers: int, fmt: str, convention: str) -> None:
    if fmt != F.SGLANG or sorted(layer_ids) == F.default_aux_layers(num_layers):
        return
    ids = F.sglang_aux_ids(sorted(layer_ids), convention)
    if not F.sglang_layers_agree(ids):
        other = "input" if convention == "output" else "output"
        log.warning("aux layers %s without layer 2: SGLang before and after PR #25454 read eagle_config ids %s "
                    "differently; this export targets the %s rule (export.sglang_aux_convention=%s), "
                    "re-export with export.sglang_aux_convention=%s for the other SGLang", sorted(layer_ids), ids,
                    "historic" if convention == "output" else "post-#25454", convention, other)


def serve_instructions(out: Path, fmt: str, verifier: str, layer_ids, num_layers: int, cfg) -> str:
    """Where the export is and one command line per framework that serves it."""
    path = str(Path(out).resolve())
    spec = {"model": path, "method": "eagle" if fmt == F.EAGLE1 else "eagle3",
            "num_speculative_tokens": cfg.export.speculative_tokens}
    vllm = f"vllm serve {shlex.quote(verifier)} --speculative-config {shlex.quote(json.dumps(spec))}"
    sglang = (f"python -m sglang.launch_server --model {shlex.quote(verifier)} --speculative-algorithm EAGLE3 "
              f"--speculative-draft-model-path {shlex.quote(path)} --speculative-num-steps {cfg.eval.depth} "
              f"--speculative-eagle-topk {cfg.eval.top_k} --speculative-num-draft-tokens {cfg.eval.total_tokens}")
    lines = [f"export ({fmt}, {cfg.export.dtype}): {path}"]
    if fmt == F.EAGLE1:
        lines += [f"serve with vLLM:   {vllm}",
                  "serve with SGLang: not this layout (SGLang's EAGLE-2 loader wants LlamaForCausalLMEagle and an "
                  "fc bias, see docs/export.md)"]
    elif fmt == F.VLLM:
        lines += [f"serve with vLLM:   {vllm}", "serve with SGLang: re-export with export.format=sglang"]
    else:
        lines.append(f"serve with SGLang: {sglang}")
        # vLLM loads this architecture too; with no aux layers named, both capture the same default layers.
        # Custom layers are written in SGLang's numbering, which vLLM would read off by one.
        lines.append(f"serve with vLLM:   {vllm}" if sorted(layer_ids) == F.default_aux_layers(num_layers)
                     else "serve with vLLM:   re-export with export.format=vllm (custom aux layers are numbered "
                          "per framework)")
    return "\n".join(lines)
