"""EAGLE-3 heads for SmolLM2 as GGUF files for llama.cpp (test_export_gguf.py, shared with the tests that
diagnose or serve such a head)."""
from __future__ import annotations

from pathlib import Path

import torch

from pipeline.export.exporter import export_head
from pipeline.heads import DraftHeadConfig, build_draft_head
from pipeline.heads.vocab import vocab_from_ids


def smollm2_head(smollm2, layers=None) -> torch.nn.Module:
    """A random EAGLE-3 head for SmolLM2 with non-trivial norms and an 8k draft vocabulary."""
    config = smollm2.model.config
    torch.manual_seed(0)
    head = build_draft_head(DraftHeadConfig.from_target(config, "eagle3", draft_vocab_size=8000, aux_layer_ids=layers))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    head.copy_from_target(smollm2.model)
    kept = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(0))[:8000]
    head.set_draft_vocab(*vocab_from_ids(kept, config.vocab_size))
    return head.eval()


def to_gguf(head, out: Path, smollm2, dtype=torch.bfloat16) -> Path:
    return export_head(head, out, "gguf", dtype, num_target_layers=smollm2.model.config.num_hidden_layers,
                       verifier="HuggingFaceTB/SmolLM2-135M-Instruct", verifier_architectures=["LlamaForCausalLM"],
                       target_dir=str(smollm2.source))
