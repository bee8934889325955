"""`python -m tests.support.lock_holder <dir> <seconds>` from the repository root (also under torchrun -m):
takes the output lock of `dir` as a stage run would (pipeline/lock.py, rank from the launcher's environment),
prints `locked rank R pid P`, holds it for `seconds`; a refusal prints the message and exits 3.

EAGLET_TEST_NO_FLOCK=1 makes flock fail as it does on a file system without it (Lustre mounted `noflock`:
ENOSYS), so the lock must fall back to its heartbeat file."""
import errno
import fcntl
import os
import sys
import time
from pathlib import Path

from pipeline.dist import rank_info
from pipeline.lock import OutputLock, OutputLocked

if os.environ.get("EAGLET_TEST_NO_FLOCK") == "1":
    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")
    fcntl.flock = no_flock

try:
    with OutputLock(Path(sys.argv[1]), "train"):
        print(f"locked rank {rank_info().rank} pid {os.getpid()}", flush=True)
        time.sleep(float(sys.argv[2]))
except OutputLocked as e:
    print(e, flush=True)
    sys.exit(3)
