"""`python -m tests.support.faulty_run <event>:<step>:<SIGNAL> <hydra overrides...>` from the repository root:
`python -m pipeline.run` with a trainer hook (pipeline/train/loop.py TrainerHook) that sends this process SIGNAL
when the trainer announces <event> at <step>, so an interruption lands at a chosen point. Events: step_done
(during step N, before its metrics are logged), step_logged (after step N is logged), tau_decoding (as step N's
real-tau decode starts), checkpoint_written (inside step N's checkpoint write, before its record),
checkpoint_recorded (after its record, before the rename)."""
import os
import signal
import sys
from pathlib import Path

import hydra

from pipeline.dist import exit_rank
from pipeline.run import execute

EVENT, STEP, SIGNAL = sys.argv.pop(1).split(":")


def fault(event: str, step: int) -> None:
    if event == EVENT and step == int(STEP):
        os.kill(os.getpid(), getattr(signal, SIGNAL))


# pipeline.run's own entry, with the hook: the same config (conf/ found by path) and the same error handling.
@hydra.main(version_base=None, config_path=str(Path(__file__).resolve().parents[2] / "conf"), config_name="config")
def main(dcfg) -> None:
    execute(dcfg, trainer_hooks=(fault,))


if __name__ == "__main__":
    main()
    exit_rank()
