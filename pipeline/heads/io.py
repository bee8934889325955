"""A trained head on disk: `<train dir>/final/` holds model.safetensors (trained weights and the d2t/t2d
vocabulary maps) and head_config.json (`DraftHeadConfig.to_dict()`).

The frozen copies of target weights (embeddings; EAGLE-1's lm_head) are never saved: `load_head` takes them
from the target itself, after checking it is the target the head was trained on."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from pipeline.files import atomic_write_text
from pipeline.manifest import ManifestError, TrainManifest, check_files, check_target

from .config import DraftHeadConfig, build_draft_head

FINAL = "final"
HEAD_WEIGHTS = "model.safetensors"
HEAD_CONFIG = "head_config.json"


def frozen_names(head: nn.Module) -> set[str]:
    """Parameters copied from the target (not trained, not saved)."""
    return {name for name, p in head.named_parameters() if not p.requires_grad}


def head_state(head: nn.Module) -> dict[str, torch.Tensor]:
    """Trained parameters and the vocabulary buffers (d2t, t2d), contiguous CPU copies."""
    skip = frozen_names(head)
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in head.state_dict().items() if k not in skip}


def save_head(head: nn.Module, directory: Path) -> None:
    """model.safetensors + head_config.json (DraftHeadConfig.to_dict(): rope_theta as trained)."""
    write_head(head_state(head), head.config.to_dict(), directory)


def write_head(state: dict[str, torch.Tensor], config: dict, directory: Path) -> None:
    """`save_head` from a snapshot (`head_state`, `config.to_dict()`): what a background checkpoint write takes
    while training goes on."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / HEAD_WEIGHTS), metadata={"format": "pt"})
    atomic_write_text(directory / HEAD_CONFIG, json.dumps(config, indent=2) + "\n")


class NonFiniteWeights(ManifestError):
    pass


def check_finite(tensors: dict[str, torch.Tensor], where: Path) -> None:
    """Refuses weights with NaN or inf, naming the tensors: such a head drafts garbage (tau 1) or worse."""
    bad = [f"{name} ({int((~torch.isfinite(t)).sum())} of {t.numel()} values)" for name, t in tensors.items()
           if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise NonFiniteWeights(f"{where}: non-finite weights in {', '.join(bad)}; retrain the head (train.on_nonfinite "
                               f"stops a run at the first non-finite loss or gradient)")


def load_head_weights(head: nn.Module, directory: Path) -> None:
    """Load `save_head` output into a freshly built head; anything missing must be a frozen target copy."""
    from safetensors.torch import load_file

    state = load_file(str(directory / HEAD_WEIGHTS))
    check_finite(state, directory / HEAD_WEIGHTS)
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = set(missing) - frozen_names(head)
    if missing or unexpected:
        raise RuntimeError(f"{directory / HEAD_WEIGHTS}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")


def load_head(train_dir: Path, target, device: Optional[torch.device] = None,
              dtype: Optional[torch.dtype] = None, allow_template_mismatch: bool = False) -> nn.Module:
    """The trained head of a completed train stage, in eval mode, with its frozen embedding (and EAGLE-1
    lm_head) copied from `target` (a pipeline.target.Target) -- which must be the target it was trained on
    (fingerprint checked against the train manifest; `allow_template_mismatch`: but for the chat template).
    Device/dtype default to the target's."""
    train_dir = Path(train_dir)
    manifest = TrainManifest.load(train_dir)
    check_target(target.fingerprint, manifest, train_dir / "manifest.json",
                 allow_template_mismatch=allow_template_mismatch)
    final = train_dir / FINAL
    if manifest.head_files is not None:  # heads trained before the digests were recorded load unchecked
        check_files(final, manifest.head_files, "trained head",
                    f"delete {final} and {train_dir / 'manifest.json'} and rerun the train stage: it rewrites the "
                    f"head from the last checkpoint")
    config = DraftHeadConfig.from_dict(json.loads((final / HEAD_CONFIG).read_text()))
    head = build_draft_head(config)
    load_head_weights(head, final)
    head.copy_from_target(target.model)
    return head.to(device=device or target.device, dtype=dtype or target.dtype).eval()
