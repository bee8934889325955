"""The root config schema. Plain dataclasses (no Hydra import): `pipeline/run.py` registers them in
Hydra's ConfigStore, YAML groups in `conf/` extend them, and logic modules receive the typed objects."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pipeline.data.config import DataConfig, SourceConfig  # noqa: F401  (re-exported)
from pipeline.eval.config import EvalConfig
from pipeline.export.config import ExportConfig
from pipeline.hidden_states.config import DumpConfig
from pipeline.regen.config import RegenConfig
from pipeline.target import TargetConfig  # noqa: F401  (re-exported)
from pipeline.train.config import HeadConfig, TrainConfig

STAGES = ("regen", "dump", "train", "eval", "export")


@dataclass
class WandbConfig:
    project: str = "eaglet"
    entity: Optional[str] = None
    mode: str = "offline"  # online | offline | disabled
    dir: Optional[str] = None  # default: the stage's output directory


@dataclass
class EagletConfig:
    stage: str = "all"  # regen | dump | train | eval | export | all
    # Experiment name; defaults to the selected `experiment` config group option.
    name: str = "demo"
    output_root: str = "outputs"
    seed: int = 0
    log_level: str = "INFO"
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    regen: RegenConfig = field(default_factory=RegenConfig)
    dump: DumpConfig = field(default_factory=DumpConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    # Output layout: regen/dump per experiment; train/eval/export per head, so heads never collide.
    @property
    def experiment_dir(self) -> Path:
        return Path(self.output_root) / self.name

    def stage_dir(self, stage: str) -> Path:
        if stage in ("regen", "dump"):
            return self.experiment_dir / stage
        if stage in ("train", "export"):
            return self.experiment_dir / stage / self.head.name
        if stage == "eval":
            return self.experiment_dir / "eval" / self.head.name / self.eval_run_name
        raise ValueError(f"unknown stage {stage!r}")

    @property
    def eval_run_name(self) -> str:
        if self.eval.run_name:
            return self.eval.run_name
        path = Path(self.eval.questions) if self.eval.questions else Path("demo_questions")
        # FastChat / EAGLE layout (data/<bench>/question.jsonl): the folder names the set.
        stem = path.parent.name if path.stem == "question" and path.parent.name else path.stem
        limit = f"-n{self.eval.limit}" if self.eval.limit else ""
        e = self.eval
        # The settings that define a run are in the name (set, limit, temperature, token budget, the target's
        # precision, the tree), so such runs sit side by side; any other difference (seed, baseline_limit,
        # head) in an existing folder is refused by the eval's identity check, never mixed.
        return (f"{stem}{limit}-T{e.temperature:g}-m{e.max_new_tokens}-{self.target_precision}"
                f"-tree{e.top_k}x{e.depth}x{e.total_tokens}")

    @property
    def target_precision(self) -> str:
        """The target's compute dtype name (`auto` resolved on this machine)."""
        from pipeline.precision import dtype_name
        from pipeline.target import resolve_device, resolve_dtype

        return dtype_name(resolve_dtype(self.target.dtype, resolve_device(self.target.device)))
