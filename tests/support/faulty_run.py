"""`python -m tests.support.faulty_run <event>:<step>:<SIGNAL> <hydra overrides...>`: `python -m pipeline.run` with a
trainer hook (pipeline/train/loop.py TRAINER_HOOKS) that sends this process SIGNAL when the trainer announces
<event> at <step>, so an interruption lands at a chosen point. Events: step_done (during step N, before its
metrics are logged), step_logged (after step N is logged), tau_decoding (as step N's real-tau decode starts),
checkpoint_written (inside step N's checkpoint write, before the rename)."""
import os
import runpy
import signal
import sys

from pipeline.train import loop

EVENT, STEP, SIGNAL = sys.argv.pop(1).split(":")


def fault(event: str, step: int) -> None:
    if event == EVENT and step == int(STEP):
        os.kill(os.getpid(), getattr(signal, SIGNAL))


loop.TRAINER_HOOKS.append(fault)

# As `python -m pipeline.run` (Hydra finds conf/ from the entry module's file); the hook stays installed, the
# trainer module being shared through sys.modules.
runpy.run_module("pipeline.run", run_name="__main__", alter_sys=True)
