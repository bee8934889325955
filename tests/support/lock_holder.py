"""`python -m tests.support.lock_holder <dir> <seconds>` from the repository root (also under torchrun -m):
takes the output lock of `dir` as a stage run would (pipeline/lock.py, rank from the launcher's environment),
prints `locked rank R pid P`, holds it for `seconds`; a refusal prints the message and exits 3."""
import os
import sys
import time
from pathlib import Path

from pipeline.dist import rank_info
from pipeline.lock import OutputLock, OutputLocked

try:
    with OutputLock(Path(sys.argv[1]), "train"):
        print(f"locked rank {rank_info().rank} pid {os.getpid()}", flush=True)
        time.sleep(float(sys.argv[2]))
except OutputLocked as e:
    print(e, flush=True)
    sys.exit(3)
