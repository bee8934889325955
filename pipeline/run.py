"""eaglet entry point: `python -m pipeline.run stage=<regen|dump|train|eval|export|all> experiment=<name>`.

Composes the Hydra config, converts it to the typed `EagletConfig`, and hands it to the stage's
`run.main`. This module and the ConfigStore registration are the only places that know about Hydra."""
from __future__ import annotations

import importlib
import logging
import os
import sys

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from pipeline.config import STAGES, EagletConfig

STAGE_MODULES = {
    "regen": "pipeline.regen.run",
    "dump": "pipeline.hidden_states.run",
    "train": "pipeline.train.run",
    "eval": "pipeline.eval.run",
    "export": "pipeline.export.run",
}

log = logging.getLogger("eaglet")


class StageUnavailable(RuntimeError):
    pass


def register_configs() -> None:
    ConfigStore.instance().store(name="eaglet_schema", node=EagletConfig)


def to_typed(cfg: DictConfig) -> EagletConfig:
    return OmegaConf.to_object(cfg)


def stage_main(stage: str):
    module_name = STAGE_MODULES[stage]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            raise StageUnavailable(f"stage '{stage}' is not built yet in this version of eaglet") from None
        raise
    return module.main


def run_stages(cfg: EagletConfig) -> None:
    stages = STAGES if cfg.stage == "all" else (cfg.stage,)
    if any(s not in STAGES for s in stages):
        raise StageUnavailable(f"unknown stage '{cfg.stage}': choose one of {', '.join(STAGES)} or all")
    mains = [(s, stage_main(s)) for s in stages]  # fail before doing any work
    for stage, main in mains:
        log.info("=== stage %s (experiment %s) ===", stage, cfg.name)
        main(_for_stage(cfg, stage))


def _for_stage(cfg: EagletConfig, stage: str) -> EagletConfig:
    import dataclasses
    return dataclasses.replace(cfg, stage=stage)


register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    cfg = to_typed(dcfg)
    logging.getLogger().setLevel(cfg.log_level)
    try:
        run_stages(cfg)
    except StageUnavailable as e:
        print(f"eaglet: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        if not is_user_error(e) or os.environ.get("EAGLET_TRACEBACK"):
            raise
        # Errors eaglet raises on purpose (bad input, mismatched manifests, refused exports) already say
        # what and where; a traceback would bury that. EAGLET_TRACEBACK=1 shows it anyway.
        print(f"eaglet: {cfg.stage}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)


def is_user_error(e: BaseException) -> bool:
    return type(e).__module__.startswith("pipeline.") or isinstance(e, FileNotFoundError)


if __name__ == "__main__":
    main()
