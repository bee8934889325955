"""Typed configs of the data layer (no Hydra imports here)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SourceConfig:
    """One input source. `format=auto` infers from the records (sharegpt, openai, alpaca, mtbench)."""

    path: str = ""
    # auto | sharegpt | openai | alpaca | mtbench | hf (datasets.load_dataset: local path or hub id)
    format: str = "auto"
    split: str = "train"
    # For `hf` sources: canonical field -> dataset column, e.g. {"conversations": "dialog"}.
    columns: dict = field(default_factory=dict)
    # Keep only the first N records of this source (None: all).
    limit: Optional[int] = None
    # Prefix of generated ids when the records carry none (default: the file stem).
    id_prefix: Optional[str] = None


@dataclass
class DataConfig:
    name: str = "demo"
    # Where the data sets live; source paths in conf/data/*.yaml are written as ${data.root}/...
    root: str = "../shared/data"
    # Empty list: the demo prompts shipped inside the package (pipeline/data/demo/prompts.jsonl).
    sources: list = field(default_factory=list)
    on_bad_record: str = "skip"  # skip | fail
    max_length: int = 2048
    overlength: str = "truncate"  # truncate | drop
    # System prompt added to every conversation that has none (None: the template's own default).
    system_prompt: Optional[str] = None
