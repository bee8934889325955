"""The one W&B initialisation of every stage that logs (train curves, eval results)."""
from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path
from typing import Optional

from pipeline.choices import Choice
from pipeline.redact import redact, redact_argv

WANDB_ID_FILE = "wandb_id.txt"


class WandbMode(Choice):
    online = "online"
    offline = "offline"
    disabled = "disabled"


def start_wandb_run(wandb_cfg, out_dir: Path, config: dict, run_name: Optional[str], job_type: str,
                    resumable: bool = False):
    """A W&B run in `wandb_cfg.mode` (WANDB_MODE in the environment wins, so `WANDB_MODE=offline` works
    anywhere), or None when disabled. Files go to `wandb_cfg.dir`, else `out_dir`. `resumable`: the run id is
    kept in `out_dir`, so a rerun of the stage (a resumed training) continues the same W&B run. The config goes
    to W&B (and its files) with its secrets redacted."""
    mode = WandbMode.parse(os.environ.get("WANDB_MODE") or wandb_cfg.mode, "wandb.mode")
    if mode == WandbMode.disabled:
        return None
    import wandb

    run_id = None
    if resumable:
        id_file = Path(out_dir) / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id + "\n")
    wandb_dir = Path(wandb_cfg.dir) if wandb_cfg.dir else Path(out_dir)
    wandb_dir.mkdir(parents=True, exist_ok=True)
    argv = sys.argv
    sys.argv = redact_argv(argv)  # W&B records the command line in its run's metadata when it starts
    try:
        return wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity, mode=str(mode), dir=str(wandb_dir),
                          config=redact(config), name=run_name, job_type=job_type,
                          **({"id": run_id, "resume": "allow"} if resumable else {}))
    finally:
        sys.argv = argv
