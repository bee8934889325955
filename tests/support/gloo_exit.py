"""`torchrun --nproc-per-node 2 -m tests.support.gloo_exit <plain|exit_rank>` from the repository root: the exit race
that pipeline.dist.exit_rank avoids, made likely. Both ranks wrap a module in DDP, which keeps the gloo group and
its worker threads alive past destroy_process_group. Rank 1 waits in an all-reduce; rank 0 joins it without
waiting and leaves at once, so its worker finishes the collective, and drops the tensor Python gave it, while
rank 0 exits. `plain`: rank 0 exits as Python does (in about 4 of 5 runs it aborts: "terminate called without
an active exception"); `exit_rank`: through pipeline.dist.exit_rank. Rank 1 always exits 0."""
import os
import sys
import time

import torch
import torch.distributed as dist

from pipeline.dist import exit_rank

dist.init_process_group("gloo")
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
dist.barrier()
tensor = torch.ones(1000)
if dist.get_rank() == 1:
    try:
        dist.all_reduce(tensor)
    except Exception:  # rank 0 may leave before it has sent its half (exit_rank does not wait for its worker)
        pass
    sys.stdout.flush()
    os._exit(0)
time.sleep(0.2)  # rank 1 is waiting in the all-reduce by now
dist.all_reduce(tensor, async_op=True)
del tensor  # only the collective holds it now
dist.destroy_process_group()
print("rank 0 leaving", flush=True)
if sys.argv[1] == "exit_rank":
    exit_rank()
