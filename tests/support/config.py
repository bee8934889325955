"""The composed config as the CLI builds it (test_config.py, shared with the tests that compose a run's config
from overrides): Hydra composition of conf/ turned into the typed config."""
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from pipeline.run import to_typed
from tests.support.paths import REPO


def compose_cfg(overrides=()):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        # ${hydra:...} resolves only inside a Hydra app; set what it would give.
        cfg.name = cfg.hydra.runtime.choices.get("experiment", "demo")
        with open_dict(cfg):
            del cfg["hydra"]
        return to_typed(cfg)
