"""`Holder`: the prepared model as the checkpoint writer reads it (pipeline/train/checkpoint.py), a module whose
`.head` is the draft head, for tests and benches that save checkpoints without a training run."""
from torch import nn


class Holder(nn.Module):
    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head
