"""Capturing the target's hidden states in one forward pass.

Convention (docs/design.md): layer id `i` is the residual stream *entering* decoder layer `i` (HF
`hidden_states[i]`, with `hidden_states[0]` the embedding output). Those are read with forward pre-hooks on
the chosen decoder layers, so only the requested layers are kept alive, not all L+1 states that
`output_hidden_states=True` would return. The final feature is the decoder body's `last_hidden_state`: the
output of the final norm, i.e. exactly what lm_head reads. Only the body runs (`get_decoder()`): the
lm_head over the whole vocabulary is not needed, since training recomputes logits from the final state.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from pipeline.heads.config import default_aux_layer_ids

CONVENTION = "input-to-layer"
FINAL_FEATURE = "final-norm-output"


def resolve_layer_ids(layer_ids: Optional[Sequence[int]], num_layers: int) -> list[int]:
    ids = default_aux_layer_ids(num_layers) if layer_ids is None else [int(i) for i in layer_ids]
    if not ids:
        raise ValueError("dump.layer_ids is empty")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"dump.layer_ids {bad} out of range: input-to-layer ids of a {num_layers}-layer "
                         f"target are 0..{num_layers - 1} (the final state is captured separately)")
    if len(set(ids)) != len(ids):
        why = (f" (the default low/mid/high rule 2, L//2, L-3 needs at least 7 layers; this target has {num_layers}: "
               "set dump.layer_ids)" if layer_ids is None else "")
        raise ValueError(f"dump.layer_ids {ids} has duplicates{why}")
    return ids


def no_autograd(model: torch.nn.Module):
    """The forward's no-autograd context: inference_mode, except on a target that transformers wrapped in FSDP2
    (target.tensor_parallel with several groups: its `dp_replicate` dimension), whose hooks refuse inference
    tensors; no_grad there (the same values)."""
    return torch.no_grad() if fsdp_wrapped(model) else torch.inference_mode()


def fsdp_wrapped(model: torch.nn.Module) -> bool:
    """transformers wrapped the target in FSDP2 (tensor parallelism with several groups: `dp_replicate`): its
    forward then runs from the root module only, and refuses inference tensors."""
    dc = getattr(model.config, "distributed_config", None)
    return dc is not None and getattr(dc, "dp_size", 1) > 1


def decoder_body(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (embeddings, layers, final norm) of a causal LM, without its lm_head."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    if not hasattr(body, "layers"):
        raise TypeError(f"{type(model).__name__}: cannot find the decoder layers (expected `.layers` on "
                        f"{type(body).__name__})")
    return body


class HiddenStateCapture:
    """Forward pre-hooks that keep the inputs of the chosen decoder layers during one forward.

        with HiddenStateCapture(model, [2, 15, 27]) as cap:
            aux, final = cap.forward(input_ids, attention_mask)   # [B, T, 3H], [B, T, H]
    """

    def __init__(self, model: torch.nn.Module, layer_ids: Sequence[int]):
        self.body = decoder_body(model)
        # FSDP2 runs a forward from its root only: the whole model then, stopping at the final norm.
        self.root = model if fsdp_wrapped(model) else None
        self.layer_ids = resolve_layer_ids(layer_ids, len(self.body.layers))
        self._states: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> "HiddenStateCapture":
        for i in self.layer_ids:
            self._handles.append(self.body.layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._states.clear()

    def _hook(self, layer_id: int):
        def hook(module, args, kwargs):
            # Layers are called with the residual stream first (positionally in HF Llama-likes).
            self._states[layer_id] = args[0] if args else kwargs["hidden_states"]
        return hook

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (aux [B, T, n_layers*H] in layer-id order, final [B, T, H]) in the target's dtype."""
        with no_autograd(self.body):
            return self._forward(input_ids, attention_mask)

    def _forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._handles:
            raise RuntimeError("HiddenStateCapture.forward outside its `with` block")
        self._states.clear()
        if self.root is not None:  # no lm_head rows (an empty index); the final norm's output is the last state
            out = self.root(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                            logits_to_keep=torch.empty(0, dtype=torch.long, device=input_ids.device),
                            output_hidden_states=[-1])
            out.last_hidden_state = out.hidden_states[-1]
        else:
            out = self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        try:
            aux = torch.cat([self._states[i] for i in self.layer_ids], dim=-1)
        except KeyError as e:
            raise RuntimeError(f"decoder layer {e} was not called: the target skipped it") from None
        finally:
            self._states.clear()
        return aux, out.last_hidden_state


def pad_batch(rows: Sequence[Sequence[int]], device: torch.device, pad_id: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pads token rows into (input_ids [B, T], attention_mask [B, T]). Under a causal mask, right
    padding leaves every real position's states unchanged (pads come after it), and positions stay 0..n-1."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.from_numpy(np.array(r, dtype=np.int64))  # a list, or a read-only mapped view
        mask[b, : len(r)] = 1
    return ids.to(device), mask.to(device)
