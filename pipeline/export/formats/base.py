"""What every export format shares, and the registry of formats.

A format is one class (an adapter in the spirit of torchtitan's state-dict adapters) that knows its serving
framework's loader: tensor names both ways, the exact tensor set, config.json written and read back (with the
aux layers in the framework's numbering), the checks on a written config, what the framework takes from the
target instead of the file, and the command line that serves it. `exporter.py` only calls these methods.
eaglet's own layer ids are input-to-layer indices (docs/design.md); every rule comes from the loader code
named in docs/export.md."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from pipeline.decoding.tree import DEFAULT_TREE, TreeSpec
from pipeline.heads.config import DraftHeadConfig

from .llama import llama_problems

# config.json spelling of a dtype, and safetensors' header spelling of each tensor dtype eaglet writes.
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float32": "F32"}
INDEX_DTYPES = {"d2t": "I64", "t2d": "BOOL"}


class ExportError(RuntimeError):
    pass


@dataclass(frozen=True)
class ExportContext:
    """What an export needs beyond the head: the target's depth, how the serving side names it, the settings
    of the serving commands."""
    num_target_layers: int
    verifier: Optional[str] = None  # the target as the serving machine names it (hub id or path)
    verifier_architectures: Sequence[str] = ()
    speculative_tokens: int = 3
    sglang_aux_convention: str = "output"
    tree: TreeSpec = DEFAULT_TREE  # the serving commands' tree
    # The target's local folder (config.json, tokenizer): what a converter that reads the target takes (gguf).
    target_dir: Optional[str] = None
    # The target's GGUF file, where it is one: what llama.cpp serves (the gguf format's command).
    target_gguf: Optional[str] = None


# ---------------------------------------------------------------------------------------------------------
# auxiliary layers (eaglet numbering)


def check_aux_layers(layer_ids: Sequence[int], num_layers: int) -> None:
    """Servable aux layers: three distinct inputs of real decoder layers. Both frameworks capture the residual
    stream *entering* a layer, once per layer, so an id of num_layers (past the last layer) or a repeated id
    would give the head fewer or other states than it was trained on."""
    ids = list(layer_ids)
    if len(ids) != 3 or len(set(ids)) != 3:
        raise ExportError(f"aux layers {ids}: EAGLE-3 serving needs 3 distinct target layers")
    if not all(0 <= i < num_layers for i in ids):
        raise ExportError(f"aux layers {ids}: ids must be decoder-layer inputs 0..{num_layers - 1} "
                          f"(the target has {num_layers} layers)")


def aux_order(layer_ids: Sequence[int]) -> list[int]:
    """Permutation sorting the aux ids: frameworks hand the head its states in ascending layer order, so a
    head trained on another order is exported with its fc column blocks permuted to match."""
    return sorted(range(len(layer_ids)), key=lambda k: layer_ids[k])


# ---------------------------------------------------------------------------------------------------------
# the format interface


class ExportFormat:
    name: str  # export.format
    kind: str  # the head kind it holds: the one declaration of which kinds export to which formats
    default: bool = False  # the kind's format when export.format is unset (one per kind)
    architecture: str  # config.json architectures[0]
    # Head tensors the serving framework takes from the target (never stored; filled from it at load-back).
    from_target: frozenset = frozenset()
    # Files the format writes beside config.json and the weights (`finish`), digested in the manifest too.
    extra_files: tuple = ()

    # -- tensors -------------------------------------------------------------------------------------------
    def to_format(self, head_name: str) -> Optional[str]:
        """eaglet head state_dict name -> this format's name (None: not stored)."""
        return None if head_name in self.from_target else head_name

    def from_format(self, name: str) -> str:
        """Inverse of to_format."""
        return name

    def expected_tensors(self, c: DraftHeadConfig) -> dict[str, tuple[int, ...]]:
        """The exact tensor set: name -> shape. Anything else in the file is an error (loaders skip unknown
        names silently, and a missing one stays at its random initialization)."""
        raise NotImplementedError

    def fill_from_target(self, head: nn.Module, model: nn.Module) -> None:
        """Copy into a loaded-back head what the format leaves to the serving framework."""

    # -- config.json ---------------------------------------------------------------------------------------
    def write_config(self, c: DraftHeadConfig, dtype: torch.dtype, ctx: ExportContext) -> dict[str, Any]:
        raise NotImplementedError

    def detects(self, cfg: dict) -> bool:
        """Whether a config.json is this format's."""
        return (cfg.get("architectures") or [None])[0] == self.architecture

    def layer_fields(self, cfg: dict) -> dict:
        """Where the one-layer Llama description lives in the config."""
        return cfg

    def read_config(self, cfg: dict, num_target_layers: int, fc_bias: bool = False,
                    sglang_convention: str = "output") -> DraftHeadConfig:
        """The DraftHeadConfig an export was written from (aux ids back in eaglet numbering)."""
        raise NotImplementedError

    def config_problems(self, cfg: dict) -> list[str]:
        """Fields the loaders read, checked on a written config.json (empty list: fine)."""
        return llama_problems(self.layer_fields(cfg))

    def loader_aux_layers(self, cfg: dict, num_target_layers: int) -> list[tuple[str, list[int], bool]]:
        """What each framework that loads this directory captures for its config.json: (loader, input-to-layer ids
        in eaglet's numbering, whether the format is written for that loader). Empty for heads that fuse no target
        layers."""
        return []

    # -- serving -------------------------------------------------------------------------------------------
    def serve_commands(self, path: str, layer_ids: Sequence[int], ctx: ExportContext) -> list[str]:
        """One line per framework: the command that serves this export, or what to do instead."""
        raise NotImplementedError

    def warn(self, layer_ids: Sequence[int], ctx: ExportContext) -> None:
        """Log what the user must know about serving this export (nothing by default)."""

    def finish(self, out_dir: Path, c: DraftHeadConfig, dtype: torch.dtype, ctx: ExportContext) -> None:
        """Writes and checks `extra_files` in `out_dir` (the export's temporary folder, config.json and the
        weights already written and checked); nothing by default."""


FORMATS: dict[str, ExportFormat] = {}


def register_format(fmt: ExportFormat) -> ExportFormat:
    if fmt.default and any(f.default and f.kind == fmt.kind and f.name != fmt.name for f in FORMATS.values()):
        raise ValueError(f"export format {fmt.name}: {fmt.kind} heads already have a default format")
    FORMATS[fmt.name] = fmt
    return fmt


def export_format(name: str) -> ExportFormat:
    try:
        return FORMATS[str(name)]
    except KeyError:
        raise ExportError(f"export.format={name!r}: choose one of {', '.join(FORMATS)}") from None


def format_for_head(name: Optional[str], kind: str) -> ExportFormat:
    """export.format for a head of `kind` (None: the kind's default format)."""
    allowed = [f for f in FORMATS.values() if f.kind == kind]
    if not allowed:
        raise ExportError(f"{kind} heads have no serving export in eaglet (an eval baseline): evaluate them with "
                          f"stage=eval")
    fmt = export_format(name) if name else next(f for f in allowed if f.default)
    if fmt not in allowed:
        raise ExportError(f"export.format={fmt.name} holds {fmt.kind} heads, but this head is {kind}: "
                          f"use {' or '.join(f.name for f in allowed)}")
    return fmt


def detect_format(cfg: dict) -> ExportFormat:
    for fmt in FORMATS.values():
        if fmt.detects(cfg):
            return fmt
    raise ExportError(f"not an eaglet export format: architectures={cfg.get('architectures')}")
