"""The training loop: objectives (a head + its loss as one module, so the parallel wrapper sees a plain
forward), AdamW with warmup + decay, gradient accumulation and clipping, validation, real-tau decoding at
checkpoints, checkpoint/resume and stop requests.

Reproducibility contract: the data order is a function of (seed, epoch) (data.py), EAGLE-1's feature noise
is seeded per micro-batch from (seed, epoch, batch position), and a checkpoint restores weights, optimizer,
scheduler and RNG states exactly, so a resumed run repeats the uninterrupted run's per-step losses, and N
processes with grad_accum=g/N repeat one process with grad_accum=g (same micro-batches per step)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from pipeline.decoding.tree import TreeSpec
from pipeline.files import atomic_dir, sha256_file
from pipeline.heads import HeadConfig, head_spec
from pipeline.heads.io import load_head_weights, save_head

from . import checkpoint as ckpt
from .config import OnScheduleChange, Schedule, Select, TrainConfig
from .data import Batch, StepSchedule, collate, epoch_batches, eval_batches
from .metrics import MetricsLog, add_stats, derive, reduce_stats

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------
# objectives (each head kind's, from the registry: pipeline/heads/)


def build_objective(head: nn.Module, head_cfg: HeadConfig, target_lm_head_weight: torch.Tensor) -> nn.Module:
    return head_spec(head.config.kind).objective_class.from_config(head, head_cfg, target_lm_head_weight)


def reads_aux(objective: nn.Module) -> bool:
    """The objective's head reads the dump's fused aux states (else the final hidden states)."""
    return head_spec(objective.head.config.kind).fuses_target_layers


def noise_seed(seed: int, epoch: int, position: int) -> int:
    """Per-micro-batch seed: independent of which rank computes the batch and of where a run resumed."""
    return (seed * 1_000_003 + epoch) * 1_000_033 + position


def micro_stats(objective: nn.Module, out: dict, batch: Batch) -> dict[str, torch.Tensor]:
    stats = {k: out[k] for k in objective.stat_shapes()}
    stats["micro"] = torch.ones(1)
    stats["tokens"] = torch.tensor([float(batch.num_tokens)])
    return stats


def zero_stats(objective: nn.Module) -> dict[str, torch.Tensor]:
    """All keys present on every rank (a rank may get no validation batch; all-reduce needs equal shapes)."""
    sums = {k: torch.zeros(n, dtype=torch.float64) for k, n in objective.stat_shapes().items()}
    sums["micro"] = torch.zeros(1, dtype=torch.float64)
    sums["tokens"] = torch.zeros(1, dtype=torch.float64)
    return sums


# ---------------------------------------------------------------------------------------------------------
# optimizer and schedule


def build_optimizer(head: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; no weight decay on norms (1-D) as usual for transformers."""
    params = [(n, p) for n, p in head.named_parameters() if p.requires_grad]
    decay = [p for _, p in params if p.dim() >= 2]
    no_decay = [p for _, p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas))


@dataclass(frozen=True)
class LrSchedule:
    """Everything the learning rate of a step depends on: recorded in every checkpoint, so a resume knows the
    schedule it continues (Trainer.resume)."""

    lr: float
    schedule: str
    warmup_steps: int
    min_lr_ratio: float
    total_steps: int
    # (step, warmup) of every carry the run continued from (carry.py): the optimizer's moments start anew there,
    # so the lr ramps again from that step over `warmup` steps. History, not settings: a resume keeps them.
    restarts: tuple = ()

    @classmethod
    def of(cls, cfg: TrainConfig, total_steps: int) -> "LrSchedule":
        return cls(float(cfg.lr), str(cfg.schedule), int(cfg.warmup_steps), float(cfg.min_lr_ratio), int(total_steps))

    @classmethod
    def from_record(cls, recorded: dict) -> "LrSchedule":
        """From `to_dict`'s record (only the fields this eaglet knows: a later one may record more)."""
        known = {f.name: recorded[f.name] for f in fields(cls) if f.name in recorded}
        known["restarts"] = tuple((int(s), int(w)) for s, w in known.get("restarts", ()))
        return cls(**known)

    def to_dict(self) -> dict:
        """The record of checkpoints and manifests; `restarts` only when there are any (older records match)."""
        d = asdict(self)
        d["restarts"] = [list(r) for r in self.restarts]
        if not self.restarts:
            del d["restarts"]
        return d

    def factor(self, step: int) -> float:
        """Multiplier of lr for the update at 0-based `step`: linear warmup from lr/warmup, then cosine or linear
        decay to min_lr_ratio at the last step, or constant; within `restarts[i][1]` steps of a restart, scaled by
        the same linear ramp from there."""
        ramp = 1.0
        for start, warmup in self.restarts:
            if warmup > 0 and start <= step < start + warmup:
                ramp = (step - start + 1) / warmup
        return ramp * self.base_factor(step)

    def base_factor(self, step: int) -> float:
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == Schedule.constant:
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps - 1)
        progress = min(1.0, (step - self.warmup_steps) / span)
        # TrainConfig checked the name: cosine or linear here
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.schedule == Schedule.cosine else 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape

    def lr_at(self, step: int) -> float:
        return self.lr * self.factor(step)

    def changes_from(self, old: "LrSchedule") -> dict[str, tuple]:
        """{field: (old, new)} of what differs; total_steps only shapes the decaying schedules (a constant one
        trained longer is the same schedule)."""
        changed = {f.name: (getattr(old, f.name), getattr(self, f.name)) for f in fields(self)
                   if getattr(old, f.name) != getattr(self, f.name)}
        if old.schedule == self.schedule == Schedule.constant:
            changed.pop("total_steps", None)
        return changed


def build_scheduler(optimizer, schedule: LrSchedule) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor)


def apply_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, schedule: LrSchedule, step: int) -> None:
    """From 0-based `step` on, the scheduler follows `schedule` alone: its factor, base lr schedule.lr (a loaded
    state's is replaced), and the optimizer's lr is schedule.lr_at(step) now."""
    groups = scheduler.optimizer.param_groups
    scheduler.lr_lambdas = [schedule.factor] * len(groups)
    scheduler.base_lrs = [schedule.lr] * len(groups)
    for group in groups:
        group["initial_lr"] = schedule.lr
    scheduler.last_epoch = step - 1
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": a fresh optimizer's (carry)
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()  # sets every group's lr (and get_last_lr) to base lr x factor(step)


# ---------------------------------------------------------------------------------------------------------
# the trainer


@dataclass
class TauProbe:
    """Real tree decoding of a few validation prompts with the target (main rank, at checkpoints)."""

    target_model: nn.Module
    prompts: Sequence[torch.Tensor]
    max_new_tokens: int
    tree: TreeSpec
    layout: Optional[object] = None  # a tensor-parallel target's TargetLayout: its group decodes in lockstep

    @torch.no_grad()
    def __call__(self, head: nn.Module) -> dict[str, float]:
        from pipeline.decoding.decoder import generate, mean_accepted_tokens
        from pipeline.decoding.drafter import lockstep, make_drafter

        was_training = head.training
        accept_lengths, t0 = [], time.perf_counter()
        try:
            for prompt in self.prompts:
                drafter = lockstep(make_drafter(head), self.layout)
                result = generate(self.target_model, drafter, prompt, self.max_new_tokens,
                                  temperature=0.0, tree=self.tree)
                accept_lengths += result.accept_lengths
        finally:
            head.train(was_training)
        # Over every verification forward of all prompts, as the eval stage's tau.
        return {"eval/tau": mean_accepted_tokens(accept_lengths), "eval/decode_s": time.perf_counter() - t0}


# A trainer hook, called as hook(event, step) at fixed points of the run (Trainer(hooks=...); a test's fault
# injector, tests/support/faulty_run.py, is one; a profiler or a custom logger could be one too):
#   "step_done"       step N's optimizer step is done, before anything is logged or saved
#   "step_logged"     step N's metrics are written (a checkpoint at N, if any, comes after)
#   "tau_decoding"    step N's real-tau decode starts (after step N's checkpoint)
#   "checkpoint_written"  step N's checkpoint is complete in its temporary directory, not yet recorded
#   "checkpoint_recorded" step N's checkpoint is in the record (checkpoint.RECORD), not yet renamed
#   (the two checkpoint events come from the writer's thread under train.async_save)
TrainerHook = Callable[[str, int], None]


class NonFiniteError(RuntimeError):
    pass


# What on_nonfinite=skip leaves out, counted in the metrics (train/skipped_*), checkpoints and the manifest.
SKIP_COUNTS = ("nonfinite_rows", "nonfinite_steps")
BEST, SELECTED = ckpt.BEST, ckpt.SELECTED


def nonfinite_rows(batch: Batch) -> list[int]:
    """Rows of a (CPU) micro-batch whose states hold a NaN or inf: one combined reduction, per row only if any."""
    states = [t for t in (batch.final_hidden, batch.aux_hidden) if t is not None]
    if bool(torch.stack([torch.isfinite(t).all() for t in states]).all()):
        return []
    bad = torch.zeros(batch.input_ids.shape[0], dtype=torch.bool)
    for t in states:
        bad |= ~torch.isfinite(t).flatten(1).all(1)
    return bad.nonzero().flatten().tolist()


def blank_rows(batch: Batch, rows: list[int]) -> None:
    """Leaves rows out of the loss without changing the batch's shape (every rank must run the same
    micro-batches for the gradient all-reduce): zero states, no loss-masked token."""
    for states in (batch.final_hidden, batch.aux_hidden):
        if states is not None:
            states[rows] = 0
    batch.loss_mask[rows] = 0


class ResumeRefused(RuntimeError):
    """A checkpoint this run cannot continue (a pipeline error: one line at the command line)."""


class StopForRequeue(SystemExit):
    def __init__(self):
        super().__init__(ckpt.REQUEUE_EXIT_CODE)


class Trainer:
    def __init__(self, cfg: TrainConfig, par, objective: nn.Module, reader, train_idx: Sequence[int],
                 val_idx: Sequence[int], lengths: Sequence[int], train_dir: Path, metrics: MetricsLog,
                 tau_probe: Optional[TauProbe] = None, identity: Optional[dict] = None,
                 hooks: Sequence[TrainerHook] = (), portable_identity: Optional[dict] = None):
        """`identity`: what a checkpoint must have been trained on to be resumed here (dump digest, head...);
        `portable_identity`: the same, as another machine would find it (the rows' content, not the manifests'
        digests), what a carry must have been trained on; `hooks`: called at the run's fixed points (TrainerHook)."""
        self.cfg, self.par, self.reader, self.identity = cfg, par, reader, identity or {}
        self.portable_identity = portable_identity or self.identity
        self.carries: list[dict] = []  # {step, carry} of each carry the run continued from; checkpointed
        self.hooks = tuple(hooks)
        self.train_idx, self.val_idx, self.lengths = list(train_idx), list(val_idx), lengths
        self.train_dir, self.metrics, self.tau_probe = Path(train_dir), metrics, tau_probe
        # Over the data split: a tensor-parallel group of ranks computes one rank's micro-batches (parallel.py).
        self.schedule = StepSchedule(cfg.grad_accum, par.data_rank, par.data_world_size)
        self._epoch_cache: tuple[int, list] = (-1, [])
        # Packing differs a little between epochs (other buckets), so each epoch has its own step count;
        # only the epochs that max_steps reaches are planned.
        self.epoch_steps: list[int] = []
        while len(self.epoch_steps) < cfg.epochs and (cfg.max_steps is None or sum(self.epoch_steps) < cfg.max_steps):
            self.epoch_steps.append(self.schedule.steps_per_epoch(len(self.batches_of_epoch(len(self.epoch_steps)))))
        if min(self.epoch_steps, default=0) == 0:
            raise ValueError(f"the training split ({len(self.train_idx)} rows) packs into fewer micro-batches of <= "
                             f"{cfg.micro_batch_tokens} tokens than one step takes ({self.schedule.micro_per_step} = "
                             f"grad_accum x processes); lower train.micro_batch_tokens or train.grad_accum, or "
                             f"dump more data")
        self.total_steps = sum(self.epoch_steps)
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self.val_batches = eval_batches(self.val_idx, lengths, cfg.micro_batch_tokens)[:cfg.val_max_batches]

        self.objective = objective
        head = objective.head
        self.params = [p for p in head.parameters() if p.requires_grad]
        optimizer = build_optimizer(head, cfg)
        self.lr_schedule = LrSchedule.of(cfg, self.total_steps)
        self.scheduler = build_scheduler(optimizer, self.lr_schedule)
        # {step, from, to} of every schedule a resume changed (on_schedule_change=apply); checkpointed
        self.schedule_changes: list[dict] = []
        self.model, self.optimizer = par.prepare(objective, optimizer)
        self.step = 0
        self.skipped = dict.fromkeys(SKIP_COUNTS, 0)  # under on_nonfinite=skip; checkpointed
        self.saver = ckpt.CheckpointWriter(train_dir, par, cfg.keep_checkpoints, background=cfg.async_save)

    def announce(self, event: str, step: Optional[int] = None) -> None:
        for hook in self.hooks:
            hook(event, self.step if step is None else step)

    # -- data --------------------------------------------------------------------------------------------------
    def locate(self, step: int) -> tuple[int, int]:
        """0-based global step -> (epoch, step within the epoch)."""
        for epoch, n in enumerate(self.epoch_steps):
            if step < n:
                return epoch, step
            step -= n
        raise IndexError("step past the last epoch")

    def batches_of_epoch(self, epoch: int) -> list[list[int]]:
        if self._epoch_cache[0] != epoch:
            self._epoch_cache = (epoch, epoch_batches(self.train_idx, self.lengths, self.cfg.micro_batch_tokens,
                                                      self.cfg.bucket_size, self.cfg.seed, epoch))
        return self._epoch_cache[1]

    def _collate(self, indices: Sequence[int], found: dict) -> Batch:
        """A micro-batch on the device. Rows with non-finite states are blanked and counted under
        on_nonfinite=skip; under fail they are recorded in found["problems"] and left in, and every rank then
        stops together at the step's end (_check_finite): a rank raising alone would leave the others
        waiting in an all-reduce."""
        batch = collate(self.reader, indices, self.cfg.max_length, reads_aux(self.objective))
        if bad := nonfinite_rows(batch):  # checked on the CPU copy: no device sync
            where = self.locate_rows([indices[r] for r in bad])
            if self.cfg.on_nonfinite == "fail":
                found.setdefault("problems", []).append(f"non-finite hidden states in {where}")
            else:
                log.warning("step %d: leaving out %d row(s) with non-finite states: %s", self.step + 1, len(bad),
                            where)
                blank_rows(batch, bad)
                found["nonfinite_rows"] = found.get("nonfinite_rows", 0) + len(bad)
        return batch.to(self.par.device)

    def locate_rows(self, indices: Sequence[int], show: int = 5) -> str:
        """Where rows come from, for messages: shard and row of a dump (DumpReader.locate), else ids; the
        first `show` of them and how many more."""
        locate = getattr(self.reader, "locate", None)
        shown = [locate(i) if locate else f"row {i} ({self.reader[i].id})" for i in indices[:show]]
        more = f" and {len(indices) - show} more rows" if len(indices) > show else ""
        return "; ".join(shown) + more

    def _check_finite(self, found: dict, losses: list, grad_norm: Optional[float], rows: list) -> bool:
        """The step's collective verdict (True: apply it): every rank's states and losses, and the all-reduced
        gradient norm. Under fail a bad step stops every rank; under skip it is skipped on every rank."""
        losses_ok = bool(torch.isfinite(torch.stack(losses)).all())
        grad_ok = grad_norm is None or math.isfinite(grad_norm)  # all-reduced: the same on every rank
        # DeepSpeed stepped inside backward, before this verdict (and ZeRO-0 reports no norm): check what it
        # applied, so that the run stops before a checkpoint can hold a non-finite head.
        weights_ok = not self.par.deepspeed or bool(torch.stack([torch.isfinite(p).all() for p in self.params]).all())
        if not self.par.any(bool(found.get("problems")) or not losses_ok or not weights_ok) and grad_ok:
            return True
        problems = list(found.get("problems", []))
        if not losses_ok:
            problems.append(f"a non-finite loss on the micro-batches of {self.locate_rows(rows)}")
        if not grad_ok:
            problems.append(f"a non-finite gradient (norm {grad_norm})")
        if not weights_ok:
            problems.append("non-finite weights after DeepSpeed's step")
        what = "; ".join(problems) or "a non-finite loss on another rank"
        if self.cfg.on_nonfinite == "fail":
            raise NonFiniteError(f"step {self.step + 1}: {what}. Repair or re-dump those rows, or set "
                                 f"train.on_nonfinite=skip to leave such rows and steps out"
                                 + (" (without DeepSpeed)" if self.par.deepspeed else ""))
        log.warning("step %d skipped: %s", self.step + 1, what)
        found["nonfinite_steps"] = 1
        return False

    @staticmethod
    def _inputs(batch: Batch) -> dict:
        return dict(input_ids=batch.input_ids, loss_mask=batch.loss_mask, attention_mask=batch.attention_mask,
                    aux_hidden=batch.aux_hidden, final_hidden=batch.final_hidden)

    # -- one optimizer step --------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        epoch, in_epoch = self.locate(self.step)
        batches = self.batches_of_epoch(epoch)
        lr = self.scheduler.get_last_lr()[0]
        sums, grad_norm, t0, found, losses = {}, None, time.perf_counter(), {}, []
        self.model.train()
        positions = self.schedule.rank_batches(len(batches), in_epoch)
        rows = [i for p in positions for i in batches[p]]
        for pos in positions:
            batch = self._collate(batches[pos], found)
            with self.par.accumulate(self.model):
                out = self.model(**self._inputs(batch), noise_seed=noise_seed(self.cfg.seed, epoch, pos))
                losses.append(out["loss"].detach())
                self.par.backward(out["loss"])
                step_ok = True
                if self.par.sync_gradients:
                    grad_norm = self.par.clip_grad_norm(self.params, self.cfg.grad_clip)
                    step_ok = self._check_finite(found, losses, grad_norm, rows)
                if step_ok:
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            add_stats(sums, micro_stats(self.objective, out, batch))
        self.scheduler.step()
        self.step += 1
        skipped = {k: found.get(k, 0) for k in SKIP_COUNTS}
        if self.cfg.on_nonfinite == "skip":  # rows are found per rank; the step verdict is already global
            skipped["nonfinite_rows"] = int(self.par.reduce_data_sum(torch.tensor(
                [float(skipped["nonfinite_rows"])], device=self.par.device)).item())
        skipped = {k: n for k, n in skipped.items() if n}  # logged only when something was left out
        for key, n in skipped.items():
            self.skipped[key] += n
        sums = reduce_stats(sums, self.par.reduce_data_sum)
        metrics = derive(sums, "train")
        metrics.update({f"train/skipped_{k}": n for k, n in skipped.items()})
        metrics.update({"lr": lr, "grad_norm": grad_norm,
                        "epoch": epoch + (in_epoch + 1) / self.epoch_steps[epoch],
                        "tokens_per_s": metrics.pop("train/tokens") / max(time.perf_counter() - t0, 1e-9)})
        return metrics

    # -- validation ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        objective = self.objective
        objective.eval()
        sums, found = zero_stats(objective), {}
        with self.par.autocast():
            for pos in range(self.par.data_rank, len(self.val_batches), self.par.data_world_size):
                batch = self._collate(self.val_batches[pos], found)
                add_stats(sums, micro_stats(objective, objective(**self._inputs(batch)), batch))
        objective.train()
        if self.par.any(bool(found.get("problems"))):  # every rank stops together (fail mode)
            raise NonFiniteError(f"validation at step {self.step}: "
                                 f"{'; '.join(found.get('problems', [])) or 'non-finite states on another rank'}. "
                                 f"Repair or re-dump those rows, or set train.on_nonfinite=skip to leave them out")
        sums = reduce_stats(sums, self.par.reduce_data_sum)
        if float(sums["micro"][0]) == 0:
            return {}
        metrics = derive(sums, "val")
        metrics.pop("val/tokens")
        return metrics

    def probe_due(self, step: int) -> bool:
        """Checkpoint steps: the scheduled ones and the last."""
        return step == self.total_steps or bool(self.cfg.save_every and step % self.cfg.save_every == 0)

    def log_real_tau(self) -> None:
        """Decodes and logs step N's real tau, after step N's checkpoint. A run resumed at a checkpoint step
        without its record (killed during the decode, or stopped by a signal) decodes it first
        (_probe_if_missing): the checkpoint restores the RNG state of before the decode, so the resumed run's
        metrics equal an uninterrupted run's."""
        self.announce("tau_decoding")
        if tau := self.real_tau():
            self.metrics.log(self.step, tau)
            log.info("step %d real tau %.3f (%.1f s)", self.step, tau["eval/tau"], tau["eval/decode_s"])
        if self.cfg.select == Select.tau:
            # best/ never runs ahead of the checkpoints: a kill before step N's (background) write is in place
            # resumes before N, where a best/ of step N would hold a head the resumed run may not repeat.
            self.saver.wait()
            self.keep_best()

    # -- train.select=tau -----------------------------------------------------------------------------------------
    def tau_record(self) -> tuple[Optional[dict], int]:
        """From metrics.jsonl (main rank): the best decoded tau so far ({step, tau}, the earliest on a tie) and
        how many probes came after it."""
        from .metrics import read_metrics

        # a carry that left the best head behind (carry.py): the probes up to it name heads this run no longer has
        after = max((c["step"] for c in self.carries if c.get("best_left_behind")), default=-1)
        probes = [(r["step"], r["eval/tau"]) for r in read_metrics(self.metrics.path)
                  if "eval/tau" in r and r["step"] > after]
        if not probes:
            return None, 0
        i = max(range(len(probes)), key=lambda k: (probes[k][1], -k))
        return {"step": probes[i][0], "tau": probes[i][1]}, len(probes) - 1 - i

    def keep_best(self) -> None:
        """best/ holds the head of the best tau so far: written when this step's probe is the best (or when a
        kill came between the probe's record and best/, on resume at that checkpoint)."""
        if not self.par.is_main:
            return
        best, _ = self.tau_record()
        path = self.train_dir / BEST
        kept = json.loads((path / SELECTED).read_text()) if (path / SELECTED).exists() else None
        if best is None or kept == best:
            return
        if best["step"] != self.step:
            log.warning("best/ holds %s, the metrics say %s: a later probe will replace it", kept, best)
            return
        with atomic_dir(path) as tmp:
            save_head(self.par.unwrap(self.model).head, tmp)
            (tmp / SELECTED).write_text(json.dumps(best) + "\n")
        log.info("step %d: best tau so far (%.3f): head kept in %s", self.step, best["tau"], path)

    def patience_spent(self) -> bool:
        """train.patience probes in a row without a better tau (agreed by every rank)."""
        spent = False
        if self.cfg.patience is not None and self.par.is_main:
            best, since = self.tau_record()
            spent = best is not None and since >= self.cfg.patience
        return self.par.any(spent)

    def _probe_if_missing(self) -> None:
        """A kill during a checkpoint step's decode, or a stop request at that step, left its checkpoint without
        the decode's record: decode now, before training on."""
        from .metrics import read_metrics

        missing = (self.par.is_main and self.tau_probe is not None and self.probe_due(self.step)
                   and not any(r["step"] == self.step and "eval/tau" in r for r in read_metrics(self.metrics.path)))
        if self.par.any(missing):
            self.log_real_tau()

    def real_tau(self) -> dict[str, float]:
        """The ranks that hold a probe decode (the main rank; with a tensor-parallel target, its group's ranks in
        lockstep); the others wait at the barrier."""
        out = {}
        if self.tau_probe is not None and self.tau_probe.prompts:
            with self.par.autocast():
                out = self.tau_probe(self.par.unwrap(self.model).head)
        self.par.barrier()
        return out

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def trainer_state(self) -> dict:
        epoch, in_epoch = self.locate(self.step) if self.step < sum(self.epoch_steps) else (len(self.epoch_steps), 0)
        cfg = self.cfg
        return {"step": self.step, "epoch": epoch, "step_in_epoch": in_epoch, "total_steps": self.total_steps,
                "world_size": self.par.world_size, "identity": self.identity, "skipped": dict(self.skipped),
                "schedule": self.lr_schedule.to_dict(), "schedule_changes": list(self.schedule_changes),
                "portable_identity": self.portable_identity, "carries": list(self.carries),
                # Everything the data order depends on: equal values give the same micro-batches per step.
                "data_order": {"seed": cfg.seed, "micro_batch_tokens": cfg.micro_batch_tokens,
                               "bucket_size": cfg.bucket_size, "max_length": cfg.max_length,
                               "micro_per_step": self.schedule.micro_per_step}}

    def save(self, wait: bool = False) -> Path:
        """Step N's checkpoint; under train.async_save written on while training goes on, unless `wait`."""
        step = self.step  # the writer's thread announces after the loop has moved on
        return self.saver.save(self.model, self.optimizer, self.scheduler, self.trainer_state(),
                               announce=lambda event: self.announce(event, step), wait=wait)

    def resume(self) -> Optional[Path]:
        """Continues from the train dir's last checkpoint, else from train.carry_from (continue_carry); returns
        the checkpoint's path (None: from a carry, or from the start)."""
        path = ckpt.latest_checkpoint(self.train_dir) if self.cfg.resume else None
        if path is None:
            if self.cfg.carry_from:
                self.continue_carry(Path(self.cfg.carry_from))
            return None
        state = ckpt.load_checkpoint(path, self.par, self.model, self.optimizer, self.scheduler,
                                     verify=self.cfg.verify_inputs)
        self._check_continues(path, state, ("identity", "data_order"))
        self._continue_at(path, state)
        log.info("resumed from %s (step %d of %d)", path, self.step, self.total_steps)
        return path

    def _check_continues(self, path: Path, state: dict, keys: Sequence[str]) -> None:
        ours = self.trainer_state()
        theirs_source, our_source = (s["identity"].get("source", "dump") for s in (state, ours))
        if theirs_source != our_source:
            raise ResumeRefused(
                f"{path}: this run started with train.source={theirs_source} and cannot resume with "
                f"train.source={our_source} (the states would come from elsewhere mid-run); rerun with "
                f"train.source={theirs_source}, or train into another head.name")
        for key in keys:  # epochs/max_steps may change: their schedule, _resume_schedule
            if state.get(key) != ours[key]:
                raise ResumeRefused(
                    f"{path}: saved with {key}={state.get(key)} but this run has {ours[key]}; it cannot continue "
                    f"that run (same dump, head and data order needed: seed, micro_batch_tokens, bucket_size, "
                    f"max_length, grad_accum x processes). Train into a new experiment, or delete "
                    f"{self.train_dir} to start over")

    def continue_carry(self, path: Path) -> None:
        """Continues a carried run (carry.py) in a train dir with no checkpoint: its bf16 weights, step, skip counts
        and lr schedule; its metrics and best/ (main rank). AdamW's moments start anew, so the lr ramps again over
        train.carry_warmup_steps (a restart in the schedule, kept by every later checkpoint)."""
        from . import carry

        if self.par.deepspeed:
            raise ResumeRefused(f"train.carry_from={path}: a carry cannot continue under DeepSpeed (its engine holds "
                                f"the fp32 master weights); resume from the run's checkpoints, or train without "
                                f"train.deepspeed_config")
        record = carry.read_carry(path)
        state = carry.trainer_state(path)
        # The inputs of a carry are its content (the tokenized rows), not its manifests: those another machine
        # writes anew, with other times and paths.
        self._check_continues(path, state, ("portable_identity", "data_order"))
        if int(state["world_size"]) != self.par.world_size:
            log.info("carry %s: written by %d processes, continued by %d (same data order)", path,
                     state["world_size"], self.par.world_size)
        self._continue_at(path, state)  # (refuses a changed schedule: before anything is written here)
        load_head_weights(self.par.unwrap(self.model).head, carry.head_path(path))
        if self.par.is_main:
            carry.restore_records(path, self.train_dir)
        warmup = 0
        if not record["complete"]:  # a complete run's carry only gives back its head
            warmup = min(self.cfg.carry_warmup_steps, max(0, self.total_steps - self.step))
            self.lr_schedule = dataclasses.replace(self.lr_schedule,
                                                   restarts=self.lr_schedule.restarts + ((self.step, warmup),))
            apply_schedule(self.scheduler, self.lr_schedule, self.step)
        self.carries.append({"step": self.step, "carry": str(path), "carry_sha256": sha256_file(path / carry.CARRY),
                             "complete": record["complete"],
                             "train_manifest_sha256": record.get("train_manifest_sha256"),
                             "machine": record.get("machine"),  # (complete runs': where the head was trained)
                             "best_left_behind": record.get("best_left_behind")})
        log.warning("continued the carried run %s (%s): bf16 weights and fresh AdamW moments, the lr ramped again "
                    "over %d steps; not the uninterrupted run (carry.py)", path, carry.describe(record), warmup)

    def _continue_at(self, path: Path, state: dict) -> None:
        self.step = int(state["step"])
        self.carries = list(state.get("carries", []))
        self.skipped.update(state.get("skipped", {}))
        self.schedule_changes = list(state.get("schedule_changes", []))
        self._resume_schedule(path, state.get("schedule"))

    def _resume_schedule(self, path: Path, recorded: Optional[dict]) -> None:
        """The loaded scheduler keeps the checkpoint's base lr while its factor is this run's: equal schedules
        continue exactly; a changed one is refused, or applied whole from the resumed step (apply_schedule), lr
        included, and recorded. A checkpoint from before the schedule was recorded resumes as before, warned."""
        new, apply = self.lr_schedule, self.cfg.on_schedule_change == OnScheduleChange.apply
        if recorded is None:
            if not apply:
                log.warning("%s does not record its lr schedule (an older eaglet): resuming as before, with its lr "
                            "and this run's schedule; train.on_schedule_change=apply applies this run's lr too", path)
                return
            said, lr_before = "the checkpoint records none", "unknown"
        else:
            old = LrSchedule.from_record(recorded)
            # the carries behind the checkpoint are its run's history: this run goes on with them
            if old.restarts:
                new = self.lr_schedule = dataclasses.replace(new, restarts=old.restarts)
                self.scheduler.lr_lambdas = [new.factor] * len(self.scheduler.lr_lambdas)
            if not (changes := new.changes_from(old)):
                return
            said = ", ".join(f"{key} {was} -> {now}" for key, (was, now) in changes.items())
            lr_before = f"{old.lr_at(self.step):.4g}"
        lr_then = f"the lr of step {self.step + 1} goes from {lr_before} to {new.lr_at(self.step):.4g}"
        if not apply:
            raise ResumeRefused(
                f"{path}: the lr schedule changed since this checkpoint ({said}; {lr_then}). Rerun with the "
                f"checkpoint's values, set train.on_schedule_change=apply to follow the new schedule from step "
                f"{self.step + 1} (recorded in the manifest), or train into another head.name")
        apply_schedule(self.scheduler, new, self.step)
        self.schedule_changes.append({"step": self.step, "from": recorded, "to": new.to_dict()})
        log.warning("step %d: the lr schedule changed (%s), applied (train.on_schedule_change=apply): %s", self.step,
                    said, lr_then)

    # -- the run ------------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Trains to total_steps from the last checkpoint (if any). Raises StopForRequeue (SystemExit 75) after
        checkpointing when a stop signal arrives. Returns the last value of every logged metric."""
        cfg = self.cfg
        last_saved = self.step if self.resume() else None  # (a carry has no checkpoint here yet)
        self.metrics.open(resume_step=self.step)
        continued = self.step > 0  # from a checkpoint or a carry
        if continued:
            self._probe_if_missing()
            if self.cfg.select == Select.tau:
                self.keep_best()
        stopped_early = continued and self.patience_spent()  # a rerun of a run that stopped early
        if self.step == 0:  # step-0 reference of the validation curves (no decode: an untrained head's tau is ~1)
            self.metrics.log(0, self.validate())
        with ckpt.StopRequest() as stop, contextlib.closing(self.saver):
            while self.step < self.total_steps and not stopped_early:
                metrics = self.train_step()
                self.announce("step_done")
                stopping = self.par.any(stop.requested)
                done = self.step == self.total_steps
                if done or (cfg.eval_every and self.step % cfg.eval_every == 0):
                    metrics.update(self.validate())
                # Logged before the checkpoint: a checkpoint at step N always has step N's record behind it.
                self.metrics.log(self.step, metrics)
                self.announce("step_logged")
                if self.par.is_main and (self.step % max(cfg.log_every, 1) == 0 or done or self.step == 1):
                    log.info("step %d/%d %s", self.step, self.total_steps, _fmt(metrics))
                if done or stopping or self.probe_due(self.step):
                    # first: a preempted or killed decode never costs the steps since the last one; a stop request's
                    # is whole before the process exits
                    self.save(wait=stopping)
                    last_saved = self.step
                    if not stopping:  # a stop request exits fast; the resumed run decodes (_probe_if_missing)
                        self.log_real_tau()
                        stopped_early = self.patience_spent()
                        if stopped_early:
                            log.info("step %d: %d tau probes without a gain (train.patience): stopping early",
                                     self.step, self.cfg.patience)
                if stopping:
                    log.warning("stopped at step %d (checkpoint saved); exiting with %d for requeue",
                                self.step, ckpt.REQUEUE_EXIT_CODE)
                    raise StopForRequeue()
            if last_saved != self.step:  # resumed from the final checkpoint with nothing left to do
                self.save()
            self.saver.wait()
        return self.final_metrics()

    def final_metrics(self) -> dict:
        """The last logged value of every metric (main rank; empty elsewhere)."""
        from .metrics import read_metrics

        last = {}
        for record in read_metrics(self.metrics.path) if self.par.is_main else []:
            last.update({k: v for k, v in record.items() if k != "step" and v is not None})
        return last


def _fmt(metrics: dict) -> str:
    keys = ("train/loss", "train/acc_0", "train/sim_tau", "val/loss", "val/sim_tau", "eval/tau", "lr",
            "grad_norm", "tokens_per_s")
    parts = []
    for k in keys:
        v = metrics.get(k)
        if v is not None:
            parts.append(f"{k}={v:.4g}")
    return " ".join(parts)
