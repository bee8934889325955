"""Stage train: `python -m pipeline.run stage=train experiment=<name> head=<eagle3|eagle1>`; several processes
with `torchrun --nproc-per-node N -m pipeline.run stage=train ...` (gloo on CPU, NCCL on GPU), DeepSpeed
ZeRO-2 with `train.deepspeed_config=conf/deepspeed/zero2.json`.

Reads the dump (`outputs/<exp>/dump`), or with `train.source=online` what the dump stage would read (the regen
output, or the data sources under dump.input=data) and computes the states in the job (online.py). Writes
`outputs/<exp>/train/<head.name>/`:
    checkpoints/step-N/   resumable state (see checkpoint.py); rerunning the command resumes from the last
    final/                model.safetensors + head_config.json (with d2t/t2d): load with pipeline.heads.io.load_head;
                          with train.select=tau the best-tau checkpoint's head (kept in best/ during the run)
    metrics.jsonl         every step's metrics; curves.png at the end; manifest.json when complete
A SIGTERM/SIGUSR1 checkpoints and exits with checkpoint.REQUEUE_EXIT_CODE (75)."""
from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from pipeline.data.chat import ThinkingMode, check_thinking
from pipeline.dist import rank_info, target_layout
from pipeline.files import atomic_dir, sha256_file
from pipeline.heads import DraftHeadConfig, build_draft_head, head_spec
from pipeline.heads.config import LmHeadInit
from pipeline.heads.io import FINAL, HEAD_CONFIG, HEAD_WEIGHTS, save_head
from pipeline.heads.vocab import build_draft_vocab
from pipeline.hidden_states.reader import REPAIR, DumpReader, verify_shards
from pipeline.manifest import FINGERPRINT_KEYS, MANIFEST, ManifestError, file_digests, to_plain, write_manifest
from pipeline.precision import dtype_name, machine_description
from pipeline.target import head_target, load_target, load_target_parts

from . import checkpoint as ckpt
from .config import Select, TrainSource
from .data import prompt_of, split_train_val, subsample, truncated_lengths
from .loop import BEST, SELECTED, TauProbe, Trainer, TrainerHook, build_objective
from .metrics import CURVES_FILE, MetricsLog, plot_curves
from .online import OnlineRows
from .parallel import Parallel

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main(cfg, hooks: Sequence[TrainerHook] = ()) -> dict:
    """Trains `cfg.head` on this experiment's dump (or online). Returns the final metrics (main rank). `hooks`
    go to the Trainer (loop.TrainerHook)."""
    # Online, a tensor-parallel group of ranks computes one rank's micro-batches (target.tensor_parallel).
    online = cfg.train.source == TrainSource.online
    par = Parallel(cfg.train, tensor_parallel=cfg.target.tensor_parallel if online else 1)
    try:
        return train(cfg, par, hooks)
    finally:
        par.end()


def train(cfg, par: Parallel, hooks: Sequence[TrainerHook] = ()) -> dict:
    t0 = time.perf_counter()
    train_dir, dump_dir = cfg.stage_dir("train"), cfg.stage_dir("dump")
    tcfg, hcfg = cfg.train, cfg.head
    if not tcfg.resume and ckpt.latest_checkpoint(train_dir) is not None:
        raise RuntimeError(f"{train_dir} has checkpoints and train.resume=false; delete it or pick another experiment")
    train_dir.mkdir(parents=True, exist_ok=True)

    online = tcfg.source == TrainSource.online
    target, reader, inputs, data_identity = load_rows(cfg, par, online)
    layer_ids = reader.layer_ids if head_spec(hcfg.kind).fuses_target_layers else None
    lengths = truncated_lengths(reader.lengths, tcfg.max_length)
    split_idx, val_idx = split_train_val(len(reader), tcfg.val_fraction, tcfg.seed)
    train_idx = subsample(split_idx, tcfg.train_fraction, tcfg.seed)
    log.info("%s: %d rows (%d train / %d validation), %d tokens", "online input" if online else f"dump {dump_dir}",
             len(reader), len(train_idx), len(val_idx), reader.num_tokens)

    frozen = head_target(target, cfg.target) if online else target  # a tensor-parallel target's parts, whole
    # The draft vocabulary counts the whole training split, so heads trained on fractions of it (ablations, the
    # data-scaling curve) share one vocabulary: at 1/8 of a 1.5M-token set only ~6k distinct tokens are seen.
    head, vocab_info = build_head(cfg, frozen, reader, split_idx, layer_ids)
    objective = build_objective(head, hcfg, frozen.model.get_output_embeddings().weight)
    tau_probe = None
    # A tensor-parallel target decodes on its group's ranks in lockstep: the first group probes, and (offline)
    # every rank loads the probe's target, its load being collective.
    probe = target_layout(cfg.target.tensor_parallel, rank_info())
    if tcfg.tau_prompts > 0 and (par.is_main or probe.sharded):
        prompts = [p for p in (prompt_of(reader[i]) for i in val_idx) if p is not None][:tcfg.tau_prompts]
        # Offline the target is only its parts (load_rows); the probe decodes, so it loads the target here.
        decoder_model = target.model if online else probe_target(cfg, par, target).model
        if par.is_main or probe.data_rank == 0:
            tau_probe = TauProbe(decoder_model, prompts, tcfg.tau_max_new_tokens, cfg.tree.fixed("train's tau probe"),
                                 layout=probe)

    identity = {**data_identity, "head": head.config.to_dict(), "train_rows": len(train_idx)}
    if par.precision != "float32":  # a resume never switches autocast (fp32 adds nothing: older runs resume)
        identity["precision"] = par.precision
    # What a carry (carry.py) from another machine must have trained on: the same target (its fingerprint without
    # the machine's path), head and recipe, and rows. Not the precision, which each machine measures (a carried
    # run is not the uninterrupted one anyway). A dump is held to its manifest (a copy of it); online, the rows'
    # content, since the regen manifests another machine restores differ in times and paths.
    portable = {k: v for k, v in identity.items() if k not in ("precision", "target_precision", "inputs")}
    portable["target"] = {k: target.fingerprint.get(k) for k in FINGERPRINT_KEYS}
    portable["recipe"] = {k: v for k, v in to_plain(hcfg).items() if k != "name"}
    if online:
        portable["rows_sha256"] = reader.digest()
    wandb_config = {"train": to_plain(tcfg), "head": to_plain(hcfg), "head_config": head.config.to_dict(),
                    "target": target.fingerprint, "experiment": cfg.name, "world_size": par.world_size}
    metrics = MetricsLog(train_dir, enabled=par.is_main, wandb_cfg=cfg.wandb, wandb_config=wandb_config,
                         run_name=f"{cfg.name}-{hcfg.name}")
    trainer = Trainer(tcfg, par, objective, reader, train_idx, val_idx, lengths, train_dir, metrics, tau_probe,
                      identity, hooks, portable_identity=portable)
    log.info("training %s (%s): %d steps (epochs of %s steps; %d micro-batches x %d processes each), %s on %s",
             hcfg.name, hcfg.kind, trainer.total_steps, trainer.epoch_steps, tcfg.grad_accum, par.world_size,
             par.mixed_precision, par.device)
    try:
        final_metrics = trainer.fit()
        if par.is_main:
            finish(cfg, trainer, head, train_dir, inputs, target, vocab_info, final_metrics, t0)
        metrics.close(summary=final_metrics)
    finally:
        metrics.close()  # also on a stop request / crash: the W&B run keeps what was logged
    return final_metrics


def load_rows(cfg, par: Parallel, online: bool):
    """(target, rows, input stage dirs, what a resumed checkpoint must have trained on). Offline the target only
    provides frozen weights (embedding, lm_head, final norm): its parts, read from the stored files without the
    model (`load_target_parts`), in fp32 unless a dtype is forced (the head copies exact weights; autocast sets
    the compute precision), and the rows are the dump's. Online the whole target also computes every batch's
    states, at the precision a dump stage would use."""
    dtype = cfg.target.dtype if online or cfg.target.dtype != "auto" else "float32"
    target = (load_target if online else load_target_parts)(
        dataclasses.replace(cfg.target, device=str(par.device), dtype=dtype))
    if online:
        rows = OnlineRows.from_config(cfg, target)
        # The input's digest, not the source's name alone: resuming on other conversations is refused too.
        digests = [sha256_file(Path(d) / MANIFEST) for d in rows.inputs] or [to_plain(cfg.data)]
        identity = {"source": "online", "inputs": digests, "layer_ids": rows.layer_ids,
                    "target_precision": target.precision}
        if cfg.regen.thinking != ThinkingMode.template:  # (absent for template: older checkpoints resume)
            identity["thinking"] = str(cfg.regen.thinking)
        return target, rows, rows.inputs, identity
    dump_dir = cfg.stage_dir("dump")
    # The layers a head fuses are the ones the dump captured (its manifest); ids set in dump.layer_ids must
    # match them (a mismatch means the dump is stale), unset ones are not recomputed here.
    fuses_layers = head_spec(cfg.head.kind).fuses_target_layers
    if cfg.train.verify_inputs:  # before any shard is parsed; each rank hashes its share, all stop if any is bad
        # Hash once: a shard verified before and unchanged since (size, mtime, ctime, inode) is trusted.
        checked = verify_shards(dump_dir, par.rank, par.world_size)
        log.info("dump verify (rank %d of %d): %s", par.rank, par.world_size, checked)
        problems = checked.problems
        if par.any(bool(problems)):
            raise ManifestError(f"dump {dump_dir}: shard {'; '.join(problems) or 'found bad by another rank'}; "
                                f"{REPAIR}")
    reader = DumpReader(dump_dir, expect_target=target.fingerprint,
                        expect_layer_ids=cfg.dump.layer_ids if fuses_layers else None, verify=False)
    check_thinking(cfg.regen.thinking, reader.manifest, dump_dir / MANIFEST)  # rows of the mode eval will render
    # No "source" key offline: checkpoints written before train.source existed still resume.
    return target, reader, [dump_dir], {"dump_manifest_sha256": sha256_file(dump_dir / MANIFEST)}


def probe_target(cfg, par: Parallel, parts):
    """The target the offline tau probe decodes with (main rank), at the precision the parts were read in; its
    fingerprint must be the parts' (same files)."""
    target = load_target(dataclasses.replace(cfg.target, device=str(par.device), dtype=dtype_name(parts.dtype)))
    if target.fingerprint != parts.fingerprint:
        raise ManifestError(f"train's tau probe: the loaded target's fingerprint {target.fingerprint} differs from "
                            f"its parts' {parts.fingerprint}")
    return target


def build_head(cfg, target, reader, vocab_idx, layer_ids):
    """The head for `cfg.head.kind`, sized from the target, with the target's frozen weights and (EAGLE-3)
    the draft vocabulary of the loss-masked tokens of rows `vocab_idx` (the training split)."""
    hcfg = cfg.head
    vocab = None
    if not head_spec(hcfg.kind).full_vocab:
        vocab = build_draft_vocab(reader.tokens(vocab_idx),
                                  target.model.config.vocab_size, hcfg.draft_vocab_size)
    config = DraftHeadConfig.from_target(target.model.config, hcfg.kind, draft_vocab_size=vocab.size if vocab else None,
                                         aux_layer_ids=layer_ids, **hcfg.architecture_options())
    seed_everything(cfg.train.seed)  # same initial weights on every rank and every rerun
    head = build_draft_head(config)
    head.copy_from_target(target.model)
    info = {"draft_vocab_size": config.draft_vocab_size}
    if vocab is not None:
        head.set_draft_vocab(vocab.d2t, vocab.t2d)
        info["coverage"] = vocab.coverage
        start = getattr(hcfg, "lm_head_init", LmHeadInit.random)  # an eagle3 option (Medusa's start from the rows)
        if start != LmHeadInit.random:
            head.init_output_from_target(target.model, copy_norm=start == LmHeadInit.target)
    return head.to(target.device), info


def finish(cfg, trainer: Trainer, head, train_dir: Path, inputs: list, target, vocab_info: dict,
           final_metrics: dict, t0: float) -> None:
    """final/ head, curves.png and the manifest (main rank)."""
    final_dir = train_dir / FINAL
    selected = None
    with atomic_dir(final_dir) as tmp:
        best = train_dir / BEST
        if cfg.train.select == Select.tau and (best / SELECTED).exists():  # the best-tau head, not the last
            selected = {**json.loads((best / SELECTED).read_text()), "last_step": trainer.step}
            for name in (HEAD_WEIGHTS, HEAD_CONFIG):
                shutil.copyfile(best / name, tmp / name)
            if selected["step"] == trainer.step:
                log.info("train.select=tau: final/ is the last step's head (%d, the best tau %.3f)", trainer.step,
                         selected["tau"])
            else:
                log.info("train.select=tau: final/ is step %d's head (tau %.3f), not step %d's", selected["step"],
                         selected["tau"], trainer.step)
        else:
            save_head(trainer.par.unwrap(trainer.model).head, tmp)
    if cfg.train.plot:
        plot_curves(train_dir / "metrics.jsonl", train_dir / CURVES_FILE,
                    title=f"{cfg.name} / {cfg.head.name} ({cfg.head.kind})")
    write_manifest(
        train_dir, "train", config={"train": cfg.train, "head": cfg.head, "target": cfg.target, "dump": cfg.dump},
        counts={"train_rows": len(trainer.train_idx), "val_rows": len(trainer.val_idx), "steps": trainer.step,
                "train_tokens": int(sum(trainer.lengths[i] for i in trainer.train_idx)),  # per epoch, after max_length
                "epoch_steps": trainer.epoch_steps, "world_size": trainer.par.world_size, **vocab_info,
                **{f"skipped_{k}": n for k, n in trainer.skipped.items()}},
        timings={"total_s": time.perf_counter() - t0}, inputs=inputs, source=str(cfg.train.source),
        target=target.fingerprint, precision=trainer.par.precision, head_config=head.config.to_dict(),
        thinking=cfg.regen.thinking,  # the template mode of its rows: eval renders with it
        final_metrics=final_metrics, head_files=file_digests(final_dir), selected=selected,
        machine=machine_description(trainer.par.device),
        schedule_changes=trainer.schedule_changes, carries=trainer.carries)
    log.info("train done: %s (final %s)", train_dir, {k: round(v, 4) for k, v in final_metrics.items()
                                                     if k in ("val/loss", "val/sim_tau", "eval/tau")})
