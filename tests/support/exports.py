"""Draft heads on the tiny target and their exports (test_export.py, shared with the tests that export, load
back, diagnose or serve heads): a random head with non-trivial norms, biases and draft vocabulary, exporting it,
its logits over a prompt, and a completed train stage to run the export stage on."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import DynamicCache

from pipeline.config import EagletConfig, TargetConfig
from pipeline.decoding.decoder import target_forward
from pipeline.export.config import ExportConfig
from pipeline.export.exporter import CONFIG, export_head
from pipeline.heads import build_draft_head, head_config
from pipeline.heads.config import DraftHeadConfig
from pipeline.heads.io import save_head
from pipeline.heads.vocab import vocab_from_ids
from pipeline.manifest import write_manifest

ROPE_THETA = 500000.0  # not the 10000 default: the config must carry the value the head was trained with
DRAFT_VOCAB = 100
VERIFIER = "org/tiny-llama"
NUM_LAYERS = 8  # the tiny target's; default aux layers [2, 4, 5]


def make_head(target, kind: str = "eagle3", aux_layer_ids=None, fc_bias: bool = False, seed: int = 0, **options):
    """A random head for `target` with non-trivial norms, biases and draft vocabulary, so that any swapped,
    missing or re-initialized tensor changes the logits. `options`: DraftHeadConfig flags (EAGLE-3.1's)."""
    cfg = DraftHeadConfig.from_target(target.config, kind, draft_vocab_size=None if kind == "eagle1" else DRAFT_VOCAB,
                                      aux_layer_ids=aux_layer_ids, rope_theta=ROPE_THETA, fc_bias=fc_bias, **options)
    torch.manual_seed(seed)
    head = build_draft_head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    head.copy_from_target(target)
    if kind == "eagle3":
        kept = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))[:DRAFT_VOCAB]
        head.set_draft_vocab(*vocab_from_ids(kept, cfg.vocab_size))
    return head.eval()


def export(head, path: Path, fmt: str, dtype=torch.float32, **kw) -> Path:
    return export_head(head, path, fmt, dtype, num_target_layers=NUM_LAYERS, verifier=VERIFIER,
                       verifier_architectures=["LlamaForCausalLM"], **kw)


def read_config(path: Path) -> dict:
    return json.loads((path / CONFIG).read_text())


def prompts(vocab: int, n: int = 3, length: int = 12) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (length,), generator=gen) for _ in range(n)]


@torch.no_grad()
def head_logits(head, target, prompt: torch.Tensor) -> torch.Tensor:
    """Logits of the head over a prompt, fed the target's real states (the decoder's prefill)."""
    layers = tuple(head.config.aux_layer_ids) or (-1,)
    _, states = target_forward(target, prompt[None], DynamicCache(config=target.config), layers)
    hidden = head.fuse(states[None])
    _, logits = head(hidden, prompt[None].roll(-1, dims=1), torch.arange(len(prompt))[None])
    return logits


def stage_config(root: Path, model_dir: Path, kind: str = "eagle3", **export_kw) -> EagletConfig:
    target = TargetConfig(name="tiny", path=str(model_dir), gguf_package=None, gguf_file=None, hub_id=VERIFIER)
    return EagletConfig(stage="export", name="t", output_root=str(root), target=target,
                        head=head_config(kind), export=ExportConfig(**export_kw))


def fake_train_stage(cfg: EagletConfig, head) -> Path:
    """A completed train stage: final/ head and a manifest naming this target."""
    from pipeline.target import load_target

    train_dir = cfg.stage_dir("train")
    save_head(head, train_dir / "final")
    write_manifest(train_dir, "train", config={}, counts={}, timings={},
                   target=load_target(cfg.target).fingerprint)
    return train_dir
