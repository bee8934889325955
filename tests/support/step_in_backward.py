"""`StepInBackward`: the real Parallel (CPU, accelerate) driving the loop in DeepSpeed's order, which the CPU cannot
run through Parallel itself (it refuses DeepSpeed without CUDA). As DeepSpeed ZeRO-0 does (measured with deepspeed
0.19.8, fp32, one CPU process: a NaN gradient's update is applied and get_global_grad_norm() is None): the
optimizer steps inside backward on the step's last micro-batch, before the loop's verdict; clipping reports no
norm; the loop's own optimizer.step() does nothing. `nan_gradient_at`: that step's gradient turns NaN after a
finite loss (a backward overflow), so neither the loss nor a norm tells the loop."""
from __future__ import annotations

import torch

from pipeline.train.parallel import Parallel


class _StepsElsewhere:
    """The loop's optimizer under DeepSpeed: step() is the engine's business (done in backward)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


class StepInBackward(Parallel):
    def __init__(self, cfg, nan_gradient_at: int):
        super().__init__(cfg)
        self.deepspeed = True  # what the loop and checkpoints branch on
        self.nan_gradient_at, self.steps = nan_gradient_at, 0

    def prepare(self, model, optimizer):
        model, self._optimizer = super().prepare(model, optimizer)
        self._params = [p for p in model.parameters() if p.requires_grad]
        return model, _StepsElsewhere(self._optimizer)

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)
        if self.sync_gradients:
            self.steps += 1
            if self.steps == self.nan_gradient_at:
                self._params[0].grad.view(-1)[0] = float("nan")
            self._optimizer.step()

    def clip_grad_norm(self, parameters, max_norm: float):
        return None

    def save_engine_state(self, model, directory) -> None:
        pass  # no engine: the head and the RNG states are what the test reads back
