"""eaglet entry point: `python -m pipeline.run stage=<regen|dump|train|eval|export|all> experiment=<name>`.

Composes the Hydra config, converts it to the typed `EagletConfig`, and hands it to the stage's
`run.main`. This module and the ConfigStore registration are the only places that know about Hydra."""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pipeline.config import STAGES, EagletConfig
from pipeline.dist import exit_rank
from pipeline.files import atomic_write_text, safe_name
from pipeline.heads import HEADS
from pipeline.lock import OutputLock
from pipeline.manifest import DiskFull, disk_full
from pipeline.redact import RedactingFilter, redact, redact_text

if TYPE_CHECKING:
    from pipeline.train.loop import TrainerHook

STAGE_MODULES = {
    "regen": "pipeline.regen.run",
    "dump": "pipeline.hidden_states.run",
    "train": "pipeline.train.run",
    "eval": "pipeline.eval.run",
    "export": "pipeline.export.run",
}

log = logging.getLogger("eaglet")


def register_configs() -> None:
    # Hydra makes its run folder (conf/config.yaml: hydra.run.dir) from `name` before the typed config checks
    # it: a bad name still gives a folder inside output_root, and the check then refuses it in one line.
    OmegaConf.register_new_resolver("eaglet_folder", lambda name: safe_name(str(name)), replace=True)
    store = ConfigStore.instance()
    store.store(name="eaglet_schema", node=EagletConfig)
    for kind, spec in HEADS.items():  # conf/head/<kind>.yaml starts from `<kind>_schema`
        store.store(group="head", name=f"{kind}_schema", node=spec.options_class)


def to_typed(cfg: DictConfig) -> EagletConfig:
    return OmegaConf.to_object(cfg)


def stage_main(stage: str):
    return importlib.import_module(STAGE_MODULES[str(stage)]).main


def wire_stages() -> None:
    """What one stage takes from another, given in this one place (stages never import each other): eval reads
    an export folder (eval.head_dir) with the export stage's reader."""
    from pipeline.eval.subjects import use_shipped_head_loader
    from pipeline.export.exporter import load_shipped_head

    use_shipped_head_loader(load_shipped_head)


def run_stages(cfg: EagletConfig, trainer_hooks: Sequence[TrainerHook] = ()) -> None:
    """Runs cfg.stage (or every stage) under its output lock; `trainer_hooks` go to the train stage's Trainer."""
    stages = STAGES if cfg.stage == "all" else (str(cfg.stage),)  # `stage` is checked at compose time
    if "eval" in stages and cfg.eval.head_dir:
        wire_stages()
    if cfg.stage == "all" and cfg.train.source == "online":  # the training job computes the states itself
        stages = tuple(s for s in stages if s != "dump")
    mains = [(s, stage_main(s)) for s in stages]
    for stage, main in mains:
        log.info("=== stage %s (experiment %s) ===", stage, cfg.name)
        staged = dataclasses.replace(cfg, stage=stage)
        out_dir = staged.stage_dir(stage)
        try:
            with OutputLock(out_dir, stage):  # one writer per output folder (pipeline/lock.py)
                main(staged, **({"hooks": trainer_hooks} if stage == "train" else {}))  # only train has hooks
        except Exception as e:
            if (full := disk_full(e)) is None:
                raise
            # Every writer renames complete files into place and removes its temporaries on failure, so the
            # next stage never reads a torn file and a rerun resumes from what was complete.
            raise DiskFull(f"no space left on the device under {out_dir} ({type(full).__name__}: {full}); free "
                           f"space and rerun the same command: it resumes from what was completed") from e


register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    execute(dcfg)


def redact_sweep_record() -> None:
    """A multirun's sweeper saves the whole config and the overrides in `<sweep dir>/multirun.yaml` before any job
    starts, whatever hydra.output_subdir says: each job rewrites it redacted (the same bytes from every job)."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    path = Path(HydraConfig.get().sweep.dir) / "multirun.yaml"
    try:
        doc = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (OSError, ValueError):
        return
    if (clean := redact(doc)) != doc:
        atomic_write_text(path, OmegaConf.to_yaml(OmegaConf.create(clean)))


def execute(dcfg: DictConfig, trainer_hooks: Sequence[TrainerHook] = ()) -> None:
    """The composed config, typed and run; an error eaglet raises on purpose ends the process with one line.
    A caller with its own Hydra entry passes trainer hooks (tests/support/faulty_run.py, its fault injector)."""
    redact_sweep_record()
    try:
        cfg = to_typed(dcfg)
    except (ValueError, TypeError) as e:
        # The schema's own checks (a choice, a range) raise builtin errors that already name the key.
        if os.environ.get("EAGLET_TRACEBACK"):
            raise
        print(redact_text(f"eaglet: config: {type(e).__name__}: {e}"), file=sys.stderr)
        sys.exit(1)
    logging.getLogger().setLevel(cfg.log_level)
    for handler in logging.getLogger().handlers:  # Hydra's: the console and <run folder>/run.log
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    try:
        run_stages(cfg, trainer_hooks)
    except Exception as e:
        if not is_user_error(e) or os.environ.get("EAGLET_TRACEBACK"):
            raise
        # Errors eaglet raises on purpose (bad input, mismatched manifests, refused exports) already say
        # what and where; a traceback would bury that. EAGLET_TRACEBACK=1 shows it anyway.
        print(redact_text(f"eaglet: {cfg.stage}: {type(e).__name__}: {e}"), file=sys.stderr)
        sys.exit(1)


def is_user_error(e: BaseException) -> bool:
    return type(e).__module__.startswith("pipeline.") or isinstance(e, FileNotFoundError)


if __name__ == "__main__":
    main()  # an error has exited already (Hydra's or execute's sys.exit)
    exit_rank()
