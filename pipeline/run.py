"""eaglet entry point: `python -m pipeline.run stage=<regen|dump|train|eval|export|all> experiment=<name>`.

Composes the Hydra config, converts it to the typed `EagletConfig`, and hands it to the stage's
`run.main`. This module and the ConfigStore registration are the only places that know about Hydra."""
from __future__ import annotations

import dataclasses
import errno
import importlib
import logging
import os
import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from pipeline.config import STAGES, EagletConfig
from pipeline.lock import OutputLock

STAGE_MODULES = {
    "regen": "pipeline.regen.run",
    "dump": "pipeline.hidden_states.run",
    "train": "pipeline.train.run",
    "eval": "pipeline.eval.run",
    "export": "pipeline.export.run",
}

log = logging.getLogger("eaglet")


def register_configs() -> None:
    ConfigStore.instance().store(name="eaglet_schema", node=EagletConfig)


def to_typed(cfg: DictConfig) -> EagletConfig:
    return OmegaConf.to_object(cfg)


def stage_main(stage: str):
    return importlib.import_module(STAGE_MODULES[str(stage)]).main


def run_stages(cfg: EagletConfig) -> None:
    stages = STAGES if cfg.stage == "all" else (str(cfg.stage),)  # `stage` is checked at compose time
    if cfg.stage == "all" and cfg.train.source == "online":  # the training job computes the states itself
        stages = tuple(s for s in stages if s != "dump")
    mains = [(s, stage_main(s)) for s in stages]
    for stage, main in mains:
        log.info("=== stage %s (experiment %s) ===", stage, cfg.name)
        staged = dataclasses.replace(cfg, stage=stage)
        with OutputLock(staged.stage_dir(stage), stage):  # one writer per output folder (pipeline/lock.py)
            main(staged)


register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    cfg = to_typed(dcfg)
    logging.getLogger().setLevel(cfg.log_level)
    try:
        run_stages(cfg)
    except Exception as e:
        if not is_user_error(e) or os.environ.get("EAGLET_TRACEBACK"):
            raise
        # Errors eaglet raises on purpose (bad input, mismatched manifests, refused exports) already say
        # what and where; a traceback would bury that. EAGLET_TRACEBACK=1 shows it anyway.
        print(f"eaglet: {cfg.stage}: {user_message(e)}", file=sys.stderr)
        sys.exit(1)


def is_user_error(e: BaseException) -> bool:
    return type(e).__module__.startswith("pipeline.") or isinstance(e, FileNotFoundError) or disk_full(e)


def disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def user_message(e: BaseException) -> str:
    if disk_full(e):
        # Every writer renames complete files into place, so what the next stage reads is never a torn file.
        return (f"no space left on the device writing {e.filename or 'an output file'} ({e.strerror}); free space "
                f"and rerun the same command: it resumes from what was completed")
    return f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    main()
