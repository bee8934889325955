"""The root config schema. Plain dataclasses (no Hydra import): `pipeline/run.py` registers them in
Hydra's ConfigStore, YAML groups in `conf/` extend them, and logic modules receive the typed objects."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pipeline.choices import Choice
from pipeline.data.config import DataConfig, SourceConfig  # noqa: F401  (re-exported)
from pipeline.data.templates import template_label
from pipeline.eval.config import EvalConfig, TreeConfig
from pipeline.export.config import ExportConfig
from pipeline.files import check_inside, check_name, folder_name, safe_name
from pipeline.heads import HeadConfig, head_config
from pipeline.hidden_states.config import DumpConfig
from pipeline.regen.config import RegenConfig
from pipeline.target import TargetConfig  # noqa: F401  (re-exported)
from pipeline.tracking import WandbMode
from pipeline.train.config import TrainConfig


class Stage(Choice):
    all = "all"  # every stage in order
    regen = "regen"
    dump = "dump"
    train = "train"
    eval = "eval"
    export = "export"


STAGES = tuple(str(s) for s in Stage if s != Stage.all)  # the pipeline's order


@dataclass
class WandbConfig:
    project: str = "eaglet"
    entity: Optional[str] = None
    mode: WandbMode = WandbMode.offline
    dir: Optional[str] = None  # default: the stage's output directory

    def __post_init__(self) -> None:
        self.mode = WandbMode.parse(self.mode, "wandb.mode")


@dataclass
class EagletConfig:
    stage: Stage = Stage.all
    # Experiment name; defaults to the selected `experiment` config group option.
    name: str = "demo"
    output_root: str = "outputs"
    seed: int = 0
    log_level: str = "INFO"
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # The schema holds the base class, so that the `head` group (conf/head/<kind>.yaml) can put the kind's own
    # options class there; built in Python without one, the kind's defaults.
    head: HeadConfig = field(default_factory=HeadConfig)
    regen: RegenConfig = field(default_factory=RegenConfig)
    dump: DumpConfig = field(default_factory=DumpConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        self.stage = Stage.parse(self.stage, "stage")
        check_name(self.name, "name")  # a folder under output_root (head.name, eval.run_name: their sections)
        if type(self.head) is HeadConfig:
            self.head = head_config(self.head.kind, name=self.head.name)

    # Output layout: regen/dump per experiment; train/eval/export per head, so heads never collide.
    @property
    def experiment_dir(self) -> Path:
        return Path(self.output_root) / check_name(self.name, "name")

    def stage_dir(self, stage: str) -> Path:
        """The stage's output folder; never outside output_root (the names are checked at construction; this
        holds for a config changed after it too, before any stage creates or deletes anything there)."""
        if stage in ("regen", "dump"):
            out = self.experiment_dir / stage
        elif stage in ("train", "export"):
            out = self.experiment_dir / stage / check_name(self.head.name, "head.name")
        elif stage == "eval":
            out = self.experiment_dir / "eval" / check_name(self.eval_subject, "eval subject") / self.eval_run_name
        else:
            raise ValueError(f"unknown stage {stage!r}")
        return check_inside(out, Path(self.output_root), f"the {stage} stage's folder")

    @property
    def eval_subject(self) -> str:
        """What an eval run measures: the head's name, the training-free drafter's (eval.drafter), or `compare`
        for several side by side (eval.compare)."""
        if self.eval.compare:
            return "compare"
        if self.eval.drafter == "head" and self.eval.head_dir:  # an exported head: its folder's name
            return folder_name(self.eval.head_dir)
        return self.head.name if self.eval.drafter == "head" else str(self.eval.drafter)

    @property
    def eval_run_name(self) -> str:
        if self.eval.run_name:
            return check_name(self.eval.run_name, "eval.run_name")
        path = Path(self.eval.questions) if self.eval.questions else Path("demo_questions")
        # FastChat / EAGLE layout (data/<bench>/question.jsonl): the folder names the set.
        stem = path.parent.name if path.stem == "question" and path.parent.name else path.stem
        stem = safe_name(stem, 64)  # a file's stem may hold anything a folder name must not (`..`, spaces)
        limit = f"-n{self.eval.limit}" if self.eval.limit else ""
        e, t = self.eval, self.tree
        # The settings that define a run are in the name (set, limit, temperature, token budget, the target's
        # precision, the tree), so such runs sit side by side; any other difference (seed, baseline_limit,
        # head) in an existing folder is refused by the eval's identity check, never mixed.
        lookup = (f"-ngram{e.lookup.min_ngram}to{e.lookup.max_ngram}" if e.drafter == "prompt_lookup" else "")
        depth, total = ("auto" if v == -1 else v for v in (t.depth, t.total_tokens))
        template = (f"-tpl-{safe_name(template_label(self.target.chat_template), 48)}" if self.target.chat_template
                    else "")
        thinking = f"-think-{self.regen.thinking}" if self.regen.thinking != "template" else ""
        return check_name(f"{stem}{limit}-T{e.temperature:g}-m{e.max_new_tokens}-{self.target_precision}"
                          f"-tree{t.top_k}x{depth}x{total}{lookup}{template}{thinking}", "eval.run_name (derived)")

    @property
    def target_precision(self) -> str:
        """The target's compute dtype name (`auto` resolved on this machine)."""
        from pipeline.precision import dtype_name, resolve_dtype
        from pipeline.target import resolve_device

        return dtype_name(resolve_dtype(self.target.dtype, resolve_device(self.target.device), "target.dtype"))
