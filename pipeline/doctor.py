"""`python -m pipeline.doctor <export dir> [--target PATH] [--train DIR] [--no-sample]`: the export doctor's command
line (the checks are pipeline/export/doctor.py; docs/export.md#doctor). Prints the report; exit code 0 when the
export is healthy, 1 with the problem lines otherwise, 2 when it cannot be examined (no such folder, a target that
does not load).

The target defaults to the one the export's manifest records (else eaglet's default target), loaded in float32 on
the CPU so that the sample compares exactly; the training checkpoint defaults to the train stage the manifest
names."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

from pipeline.export.doctor import diagnose
from pipeline.manifest import MANIFEST, ExportManifest, ManifestError
from pipeline.target import TargetConfig, TargetError, load_target, load_target_parts


def target_config(export_dir: Path, path: Optional[str]) -> TargetConfig:
    """`--target` (a local HF folder, .gguf file or hub id), else the target the export's manifest records, else
    eaglet's default target; float32 on the CPU whichever."""
    recorded = {}
    if path is None and (Path(export_dir) / MANIFEST).is_file():
        try:
            recorded = dict(ExportManifest.load(export_dir).config.get("target") or {})
        except ManifestError:
            recorded = {}
    known = {f.name for f in dataclasses.fields(TargetConfig)}
    base = TargetConfig(**{k: v for k, v in recorded.items() if k in known})
    if path is not None:
        base = TargetConfig(name=Path(path).stem or path, path=path, gguf_package=None, gguf_file=None, hub_id=None)
    return dataclasses.replace(base, device="cpu", dtype="float32", tensor_parallel=1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.doctor", description=(
        "Lint an eaglet export (sglang, vllm, eagle1, gguf) for the mismatches that make a draft head load and "
        "serve at tau ~1, and compare one sample through the training forward and each loader."))
    parser.add_argument("export_dir", type=Path, help="the export folder (config.json, model.safetensors)")
    parser.add_argument("--target", help="the target (HF folder, .gguf or hub id); default: the one the export's "
                                         "manifest records, else eaglet's default target")
    parser.add_argument("--train", type=Path, help="the train stage folder to compare with; default: the one the "
                                                   "export's manifest names")
    parser.add_argument("--no-sample", action="store_true", help="static checks only: read the target's embedding "
                                                                 "and lm_head, do not run it")
    parser.add_argument("--sglang-aux-convention", choices=["output", "input"],
                        help="how load_export reads SGLang's eagle_config layer ids (default: as exported)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not (args.export_dir / "config.json").is_file():
        print(f"{args.export_dir}: no config.json (not an export folder)", file=sys.stderr)
        return 2
    cfg = target_config(args.export_dir, args.target)
    try:
        target = load_target_parts(cfg) if args.no_sample else load_target(cfg)
    except (TargetError, FileNotFoundError, ValueError) as e:
        print(f"target {cfg.path or cfg.name}: {e}", file=sys.stderr)
        return 2
    diagnosis = diagnose(args.export_dir, target, train_dir=args.train, run_sample=not args.no_sample,
                         sglang_aux_convention=args.sglang_aux_convention)
    print(diagnosis.report())
    return 0 if diagnosis.healthy else 1


if __name__ == "__main__":
    sys.exit(main())
