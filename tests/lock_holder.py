"""`python tests/lock_holder.py <dir> <seconds>` (also under torchrun): takes the output lock of `dir` as a stage
run would (pipeline/lock.py, rank from the launcher's environment), prints `locked rank R pid P`, holds it for
`seconds`; a refusal prints the message and exits 3."""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.dist import rank_info  # noqa: E402
from pipeline.lock import OutputLock, OutputLocked  # noqa: E402

try:
    with OutputLock(Path(sys.argv[1]), "train"):
        print(f"locked rank {rank_info().rank} pid {os.getpid()}", flush=True)
        time.sleep(float(sys.argv[2]))
except OutputLocked as e:
    print(e, flush=True)
    sys.exit(3)
