"""Stage train on a tiny dump made by the real dump stage from the tiny random Llama: data order and batching,
LR schedule, manifest refusals, an end-to-end run per head (metrics.jsonl, W&B offline history, final/ head,
load_head, curves, manifest) and rerunning a finished stage.

The helpers (tiny dump, overrides usable both as Hydra CLI arguments and as a typed config) live in
tests/support/tiny_runs.py, shared with test_train_resume.py, test_train_ddp.py and the other tests of train runs;
the `dump_root` fixture is in conftest.py."""
from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch

from pipeline.config import WandbConfig
from pipeline.files import sha256_file
from pipeline.heads.io import load_head
from pipeline.hidden_states.reader import DumpReader
from pipeline.manifest import ManifestError, load_manifest
from pipeline.train import checkpoint as ckpt
from pipeline.train.config import TrainConfig
from pipeline.train.data import StepSchedule, collate, epoch_batches, pack, split_train_val, subsample
from pipeline.train.loop import LrSchedule
from pipeline.train.metrics import read_metrics
from tests.support.paths import REPO
from tests.support.tiny_runs import EXPERIMENT, as_config, overrides, tiny_target

# ---------------------------------------------------------------------------------------------------------
# data order and batching


def test_split_is_seeded_disjoint_and_complete():
    train, val = split_train_val(41, 0.15, seed=0)
    assert sorted(train + val) == list(range(41)) and len(val) == 6
    assert split_train_val(41, 0.15, seed=0) == (train, val)
    assert split_train_val(41, 0.15, seed=1)[1] != val
    assert len(split_train_val(5, 0.01, seed=0)[1]) == 1  # a positive fraction always holds out a row


def test_train_fraction_keeps_nested_seeded_subsets_of_the_training_rows():
    train, val = split_train_val(200, 0.05, seed=0)
    half, quarter = subsample(train, 0.5, seed=0), subsample(train, 0.25, seed=0)
    assert len(half) == 95 and len(quarter) == 48 and set(quarter) < set(half) < set(train)
    assert not set(half) & set(val) and half == sorted(half)
    assert subsample(train, 0.5, seed=0) == half and subsample(train, 0.5, seed=1) != half
    assert subsample(train, 1.0, seed=0) == train and subsample(train, 0.001, seed=0) != []
    with pytest.raises(ValueError, match="train_fraction"):
        subsample(train, 0.0, seed=0)


def test_packing_respects_the_token_budget_and_covers_every_row_once():
    lengths = [5, 40, 12, 90, 33, 7, 64, 64, 3, 120]
    batches = epoch_batches(range(10), lengths, max_tokens=128, bucket_size=4, seed=3, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(10))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 128
    assert epoch_batches(range(10), lengths, 128, 4, seed=3, epoch=0) == batches  # (seed, epoch) -> order
    assert epoch_batches(range(10), lengths, 128, 4, seed=3, epoch=1) != batches
    assert pack([3], [0, 0, 0, 500], 128) == [[3]]  # longer than the budget: alone


def test_step_schedule_splits_a_step_across_ranks_like_grad_accum():
    one = StepSchedule(grad_accum=2)
    ranks = [StepSchedule(grad_accum=1, rank=r, world_size=2) for r in range(2)]
    for step in range(3):
        assert sorted(ranks[0].rank_batches(7, step) + ranks[1].rank_batches(7, step)) == one.rank_batches(7, step)
    assert one.steps_per_epoch(7) == 3  # the partial block at the end of an epoch is dropped
    with pytest.raises(IndexError):
        one.rank_batches(7, 3)


def test_lr_schedule_warmup_then_cosine_or_linear_to_the_floor():
    cos = LrSchedule.of(TrainConfig(warmup_steps=4, schedule="cosine", min_lr_ratio=0.1), total_steps=20)
    assert [cos.factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cos.factor(4) == pytest.approx(1.0)
    assert cos.factor(19) == pytest.approx(0.1)
    lin = LrSchedule.of(TrainConfig(warmup_steps=0, schedule="linear"), total_steps=11)
    assert lin.factor(0) == 1.0 and lin.factor(5) == pytest.approx(0.5)


def test_collate_right_pads_and_truncates(dump_root):
    reader = DumpReader(dump_root / EXPERIMENT / "dump")
    rows = [0, 1, 2]
    batch = collate(reader, rows, max_length=50, with_aux=True)
    t = min(50, max(int(reader.lengths[i]) for i in rows))
    assert batch.input_ids.shape == (3, t) and batch.aux_hidden.shape == (3, t, 3 * reader.hidden_size)
    for r, i in enumerate(rows):
        n = min(int(reader.lengths[i]), 50)
        s = reader[i]
        assert batch.attention_mask[r].sum() == n and not batch.attention_mask[r, n:].any()
        assert torch.equal(batch.input_ids[r, :n], s.input_ids[:n])
        assert torch.equal(batch.final_hidden[r, :n], s.final_hidden[:n].float())
        assert not batch.loss_mask[r, n:].any() and not batch.final_hidden[r, n:].any()
    assert collate(reader, rows, 50, with_aux=False).aux_hidden is None


# ---------------------------------------------------------------------------------------------------------
# the manifest check comes first


def _copy_target(src: Path, dst: Path, chat_template: str | None = None, reseed: bool = False) -> Path:
    shutil.copytree(src, dst)
    if chat_template is not None:
        cfg_path = dst / "tokenizer_config.json"
        tok_cfg = json.loads(cfg_path.read_text())
        tok_cfg["chat_template"] = chat_template
        cfg_path.write_text(json.dumps(tok_cfg))
        (dst / "chat_template.jinja").unlink(missing_ok=True)
    if reseed:
        from tests.support.tiny import build_tiny_llama

        build_tiny_llama(json.loads((dst / "config.json").read_text())["vocab_size"], seed=1).save_pretrained(dst)
    return dst


def test_dump_from_another_target_tokenizer_or_layer_list_is_refused(dump_root, tiny_model_dir, tmp_path):
    from pipeline.train.run import main

    other_weights = _copy_target(tiny_model_dir, tmp_path / "other_weights", reseed=True)
    other_template = _copy_target(tiny_model_dir, tmp_path / "other_template",
                                  chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    base = overrides(dump_root, tiny_model_dir, "eagle3", "refused")
    for target_dir, what in ((other_weights, "weights digest"), (other_template, "tokenizer digest")):
        with pytest.raises(ManifestError, match=what) as e:
            main(as_config({**base, "target.path": str(target_dir)}))
        assert str(target_dir) in str(e.value) and "dump" in str(e.value)  # names both sides
    cfg = as_config(base)
    cfg.dump.layer_ids = [1, 3, 5]
    with pytest.raises(ManifestError, match=r"dump layer ids mismatch(.|\n)*\[1, 3, 5\](.|\n)*\[2, 4, 5\]"):
        main(cfg)
    assert not (dump_root / EXPERIMENT / "train" / "refused" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------------------
# end to end


def read_wandb_history(run_file: Path) -> list[dict]:
    """History rows of an offline W&B run: the .wandb file is a LevelDB-style log (7-byte file header,
    32 KiB blocks, records of [crc32 u32][length u16][type u8] + payload, FULL/FIRST/MIDDLE/LAST chunks)
    whose payloads are wandb_internal_pb2.Record protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, chunk, rows = run_file.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a record header never straddles a block: the tail is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_eagle3_trains_end_to_end_with_offline_wandb(dump_root, tiny_model_dir, tmp_path):
    from pipeline.heads.vocab import build_draft_vocab
    from pipeline.target import load_target
    from pipeline.train.run import main

    d = overrides(dump_root, tiny_model_dir, "eagle3", "e3", **{"max_steps": 10, "epochs": 3, "train_fraction": 0.5})
    cfg = as_config(d)
    cfg.wandb = WandbConfig(project="eaglet-test", mode="offline", dir=str(tmp_path / "wb"))
    final = main(cfg)
    train_dir = dump_root / EXPERIMENT / "train" / "e3"

    records = read_metrics(train_dir / "metrics.jsonl")
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 11))
    keys = {"train/loss", "train/loss_0", "train/loss_2", "train/acc_0", "train/acc_2", "train/sim_tau", "lr",
            "grad_norm", "tokens_per_s"}
    assert keys <= set(train[0])
    assert [r["lr"] for r in train[:3]] == pytest.approx([1.5e-3, 3e-3, LrSchedule.of(cfg.train, 10).lr_at(2)])
    for r in train:  # sim_tau is the chain formula over this step's per-round accuracies
        acc = [r[f"train/acc_{k}"] for k in range(3)]
        assert r["train/sim_tau"] == pytest.approx(1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2])
    val = {r["step"]: r["val/sim_tau"] for r in records if "val/sim_tau" in r}
    assert sorted(val) == [0, 4, 8, 10]
    assert val[10] > val[0] == 1.0  # an untrained head never matches the target's top-1
    taus = {r["step"]: r["eval/tau"] for r in records if "eval/tau" in r}
    assert sorted(taus) == [4, 8, 10] and all(t >= 1.0 for t in taus.values())  # at every checkpoint
    assert final["val/sim_tau"] == val[10]

    # W&B offline: the run's history holds the same keys and steps.
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    history = read_wandb_history(runs[0])
    deadline = time.monotonic() + 30  # wandb's service may still be flushing the offline file after finish()
    while not history and time.monotonic() < deadline:
        time.sleep(0.5)
        history = read_wandb_history(runs[0])
    assert {"train/loss", "train/acc_0", "train/sim_tau", "lr", "val/sim_tau", "eval/tau"} <= set().union(*history)
    assert max(row["_step"] for row in history) == 10

    # Checkpoints: the last two, complete; the final head; curves; manifest.
    assert [p.name for p in ckpt.checkpoint_dirs(train_dir)] == ["step-8", "step-10"]
    assert not list((train_dir / "checkpoints").glob(".*"))
    assert (train_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    manifest = load_manifest(train_dir, expect_stage="train")
    dump_dir = dump_root / EXPERIMENT / "dump"
    assert manifest["inputs"][0]["manifest_sha256"] == sha256_file(dump_dir / "manifest.json")
    assert manifest["counts"]["steps"] == 10

    # final/: trained weights + vocab maps, no frozen target copies; rope_theta as trained.
    from safetensors.torch import load_file

    weights = load_file(str(train_dir / "final" / "model.safetensors"))
    assert "embed_tokens.weight" not in weights and {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= set(weights)
    head_config = json.loads((train_dir / "final" / "head_config.json").read_text())
    assert head_config["rope_theta"] == cfg.head.rope_theta and head_config["aux_layer_ids"] == [2, 4, 5]

    # The draft vocabulary is the most frequent loss-masked tokens of the whole training split, not of the
    # half trained on (heads at several fractions share it).
    reader = DumpReader(dump_dir)
    split_idx, _ = split_train_val(len(reader), cfg.train.val_fraction, cfg.train.seed)
    vocab = build_draft_vocab(((reader[i].input_ids, reader[i].loss_mask) for i in split_idx), 384, 200)
    assert torch.equal(weights["d2t"], vocab.d2t) and torch.equal(weights["t2d"], vocab.t2d)
    assert head_config["draft_vocab_size"] == vocab.size
    half = subsample(split_idx, 0.5, cfg.train.seed)
    assert manifest["counts"]["train_rows"] == len(half) < len(split_idx)
    of_half = build_draft_vocab(((reader[i].input_ids, reader[i].loss_mask) for i in half), 384, 200)
    assert not torch.equal(of_half.t2d, vocab.t2d)

    # load_head: the trained weights, embeddings from the target, eval mode; a foreign target is refused.
    target = load_target(tiny_target(tiny_model_dir))
    head = load_head(train_dir, target)
    assert not head.training
    assert torch.equal(head.fc.weight, weights["fc.weight"])
    assert torch.equal(head.embed_tokens.weight, target.model.get_input_embeddings().weight)
    foreign = dict(target.fingerprint, weights_digest="0" * 16)
    with pytest.raises(ManifestError, match="weights digest"):
        load_head(train_dir, type(target)(**{**target.__dict__, "fingerprint": foreign}))


def test_eagle1_trains_and_a_rerun_of_a_finished_stage_changes_nothing(dump_root, tiny_model_dir):
    from safetensors.torch import load_file

    from pipeline.target import load_target
    from pipeline.train.run import main

    d = overrides(dump_root, tiny_model_dir, "eagle1", "e1", **{"max_steps": 6, "save_every": 3,
                                                                  "eval_every": 3, "train_fraction": 0.5})
    main(as_config(d))
    train_dir = dump_root / EXPERIMENT / "train" / "e1"
    counts = load_manifest(train_dir, "train")["counts"]
    reader = DumpReader(dump_root / EXPERIMENT / "dump")
    train_idx = subsample(split_train_val(len(reader), 0.15, 0)[0], 0.5, 0)
    assert counts["train_rows"] == len(train_idx) < len(split_train_val(len(reader), 0.15, 0)[0])
    assert counts["train_tokens"] == sum(int(reader.lengths[i]) for i in train_idx)  # per epoch (rows < max_length)
    records = read_metrics(train_dir / "metrics.jsonl")
    last = [r for r in records if "train/loss" in r][-1]
    assert last["step"] == 6 and {"train/feature_loss", "train/token_loss", "train/acc_0"} <= set(last)
    assert last["train/sim_tau"] == pytest.approx(1 + last["train/acc_0"])  # no TTT: one round
    weights = load_file(str(train_dir / "final" / "model.safetensors"))
    assert not {"embed_tokens.weight", "lm_head.weight"} & set(weights)  # frozen target copies
    head = load_head(train_dir, load_target(tiny_target(tiny_model_dir)))
    assert torch.equal(head.layers[0].mlp.up_proj.weight, weights["layers.0.mlp.up_proj.weight"])

    before = (train_dir / "metrics.jsonl").read_text()
    main(as_config(d))  # resumes at the final checkpoint: nothing left to train
    assert (train_dir / "metrics.jsonl").read_text() == before
    assert [p.name for p in ckpt.checkpoint_dirs(train_dir)] == ["step-3", "step-6"]


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed (GPU only; here: the config and the CPU refusal)


def test_deepspeed_zero2_config_takes_accumulation_and_clipping_from_the_train_config():
    from accelerate import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(hf_ds_config=str(REPO / "conf" / "deepspeed" / "zero2.json"),
                             gradient_accumulation_steps=3, gradient_clipping=0.5)
    c = plugin.deepspeed_config
    assert c["zero_optimization"]["stage"] == 2
    assert c["gradient_accumulation_steps"] == 3 and c["gradient_clipping"] == 0.5
    assert c["bf16"]["enabled"] == "auto"  # accelerate fills it from mixed_precision at prepare time


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU-only machines")
def test_deepspeed_on_cpu_is_refused_with_a_clear_message():
    from pipeline.train.parallel import Parallel

    with pytest.raises(ValueError, match="needs CUDA GPUs"):
        Parallel(TrainConfig(deepspeed_config=str(REPO / "conf" / "deepspeed" / "zero2.json")))


def test_skip_is_refused_under_deepspeed_however_it_is_asked_for(monkeypatch):
    """`accelerate launch` with a DeepSpeed plugin asks through the environment, not the train config: Parallel
    refuses on_nonfinite=skip for it too (with a config file, and with `--use_deepspeed` alone), and for a
    DeepSpeed regime accelerate would choose with nothing asking (its state read after the Accelerator is built)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from pipeline.train.config import TrainSetupError
    from pipeline.train.parallel import Parallel

    refusal = r"train.on_nonfinite=skip cannot run under DeepSpeed \(accelerate launch's DeepSpeed plugin"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    for config_file in (str(REPO / "conf" / "deepspeed" / "zero2.json"), None):
        if config_file:
            monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", config_file)
        else:
            monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
        with pytest.raises(TrainSetupError, match=refusal):
            Parallel(TrainConfig(on_nonfinite="skip"))
        if not torch.cuda.is_available():  # fail mode asks for DeepSpeed itself, which the CPU refuses
            with pytest.raises(TrainSetupError, match="accelerate launch's DeepSpeed plugin.*needs CUDA GPUs"):
                Parallel(TrainConfig())
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")

    monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self: DistributedType.DEEPSPEED))
    with pytest.raises(TrainSetupError, match=r"cannot run under DeepSpeed \(chosen by accelerate\)"):
        Parallel(TrainConfig(on_nonfinite="skip"))
    monkeypatch.undo()
    par = Parallel(TrainConfig(on_nonfinite="skip"))  # the refusal reset accelerate's state behind it
    try:
        assert not par.deepspeed
    finally:
        par.end()
