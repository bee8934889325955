"""Alignment of dump samples into draft-head training pairs, and the losses/metrics of both heads.

Alignment (both heads). `hidden[t]` is the target's state of tokens <= t. It pairs with the embedding of
token t+1 to predict token t+2, whose target distribution is lm_head(final_hidden[t+1]). The loss mask
belongs to the predicted token, so position t carries loss_mask[t+2]. Positions whose t+2 falls past the
sequence (or into padding) are masked out; tensors keep their length T (zero-filled tails) so every
TTT round is a plain shift of the same tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .layers import padded_causal_mask

# EAGLE-1 defaults of the official trainer (eagle/train/main.py: v_w=1.0, p_w=0.1, uniform noise std=0.2).
EAGLE1_FEATURE_WEIGHT = 1.0
EAGLE1_TOKEN_WEIGHT = 0.1
EAGLE1_NOISE_SCALE = 0.2


def shift_left(x: torch.Tensor, n: int, fill: float = 0) -> torch.Tensor:
    """x[:, t] <- x[:, t+n] along dim 1 (the sequence), tail filled with `fill`; n == 0 returns x."""
    if n == 0:
        return x
    tail = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], tail], dim=1)


@dataclass
class AlignedBatch:
    hidden: torch.Tensor  # [B,T,3H] aux states (eagle3) or [B,T,H] final feature (eagle1) of tokens <= t
    input_ids: torch.Tensor  # [B,T] token t+1
    target_hidden: torch.Tensor  # [B,T,H] final feature of tokens <= t+1 (reads out token t+2)
    loss_mask: torch.Tensor  # [B,T] bool: token t+2 is trained on (and t, t+2 are real tokens)
    attention_mask: torch.Tensor  # [B,T] bool: position t is a real token
    position_ids: torch.Tensor  # [B,T] RoPE positions of the round-0 queries


def align_batch(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    hidden: torch.Tensor,
    final_hidden: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
) -> AlignedBatch:
    """Build the shifted training tensors from a (padded) dump batch.

    input_ids, loss_mask, attention_mask: [B,T]; hidden: [B,T,3H] (eagle3 aux states) or [B,T,H]
    (eagle1: pass final_hidden again); final_hidden: [B,T,H]. Padding may be on either side; positions
    count from the first real token of each row."""
    if input_ids.dim() == 1:  # a single DumpSample
        input_ids, loss_mask, hidden, final_hidden = (x[None] for x in (input_ids, loss_mask, hidden, final_hidden))
        attention_mask = None if attention_mask is None else attention_mask[None]
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    predicted = shift_left(loss_mask.bool() & valid, 2, False)
    return AlignedBatch(
        hidden=hidden,
        input_ids=shift_left(input_ids, 1),
        target_hidden=shift_left(final_hidden, 1),
        loss_mask=predicted & valid,
        attention_mask=valid,
        position_ids=(valid.long().cumsum(1) - 1).clamp_min(0),
    )


@torch.no_grad()
def target_distribution(
    target_hidden: torch.Tensor, lm_head_weight: torch.Tensor, t2d: torch.Tensor, chunk_rows: int = 2048,
    rows_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target next-token distribution restricted to the draft vocabulary.

    target_hidden [B,T,H], lm_head_weight [V,H] (frozen target head), t2d bool [V]
    -> probs [B,T,V_draft] fp32 (softmax over the draft-vocab logits, i.e. renormalized) and
       top1 [B,T] target ids of the argmax over the FULL vocabulary. Chunked over rows so the full-vocab
       logits never exist for the whole batch at once. With rows_mask [B,T] bool only those rows are
       computed (the others stay 0): the full-vocab teacher is a large share of a step, and prompt rows
       never enter a loss."""
    b, t, h = target_hidden.shape
    rows = target_hidden.reshape(b * t, h)
    index = None if rows_mask is None else rows_mask.reshape(-1).nonzero().squeeze(1)
    if index is not None:
        rows = rows.index_select(0, index)
    alloc = torch.empty if index is None else torch.zeros
    probs = alloc(b * t, int(t2d.sum()), dtype=torch.float32, device=rows.device)
    top1 = alloc(b * t, dtype=torch.long, device=rows.device)
    # The teacher in fp32 even under bf16 autocast: its argmax decides which positions count.
    with torch.autocast(rows.device.type, enabled=False):
        w = lm_head_weight.float()
        for s in range(0, rows.shape[0], chunk_rows):
            logits = rows[s : s + chunk_rows].float() @ w.T  # [n,V]
            dst = slice(s, s + chunk_rows) if index is None else index[s : s + chunk_rows]
            top1[dst] = logits.argmax(-1)
            probs[dst] = logits[:, t2d].softmax(-1)
    return probs.view(b, t, -1), top1.view(b, t)


class _SoftCrossEntropy(torch.autograd.Function):
    """Row-wise -sum_v p_v log softmax(z)_v with p = probs[rows], in fp32.

    Saves only the logits: p is read back from the shared `probs` tensor in backward, so a round of TTT
    does not pin its own gathered [N, V_draft] copy of the target distribution until backward."""

    @staticmethod
    def forward(ctx, logits, probs, rows):
        z = logits.float()
        lse = torch.logsumexp(z, dim=-1)
        loss = lse - (probs.index_select(0, rows) * z).sum(-1)
        ctx.save_for_backward(logits, lse, probs, rows)
        return loss

    @staticmethod
    def backward(ctx, grad):
        logits, lse, probs, rows = ctx.saved_tensors
        g = torch.exp(logits.float() - lse[:, None])  # softmax(z)
        g.sub_(probs.index_select(0, rows)).mul_(grad[:, None])
        return g.to(logits.dtype), None, None


def soft_cross_entropy(
    logits: torch.Tensor, probs: torch.Tensor, rows: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Soft cross-entropy per row of `logits` [N,V] against the normalized distributions probs[rows]
    ([M,V] fp32, no grad; rows [N] long, default arange(N)) -> [N] fp32."""
    if rows is None:
        rows = torch.arange(logits.shape[0], device=logits.device)
    return _SoftCrossEntropy.apply(logits, probs.float(), rows)


def eagle3_round_loss(
    logits_fn,
    out_hidden: torch.Tensor,
    loss_mask: torch.Tensor,
    target_probs: torch.Tensor,
    target_top1: torch.Tensor,
    shift: int,
    t2d: torch.Tensor,
    d2t: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss and accuracy counts of one EAGLE-3 prediction round.

    out_hidden [B,T,H] (pre-norm) and loss_mask [B,T] are this round's; target_probs [B,T,V_draft] and
    target_top1 [B,T] are aligned for round 0 and read at t+shift. Only positions that are loss-masked AND
    whose target top-1 (over the full vocabulary) lies in the draft vocabulary enter the loss (the draft
    could never produce the others); accuracy counts over ALL loss-masked positions, so a target outside
    the draft vocabulary is a miss. Logits are computed for the counted rows only.
    Returns (loss = mean soft CE over counted rows (0 if none), correct, total, counted)."""
    bsz, seq = loss_mask.shape
    top1 = shift_left(target_top1, shift)
    counted = loss_mask & t2d[top1]
    b, t = counted.nonzero(as_tuple=True)
    logits = logits_fn(out_hidden[b, t])  # [N,V_draft]
    ce = soft_cross_entropy(logits, target_probs.view(bsz * seq, -1), b * seq + t + shift)
    n = counted.sum()
    loss = ce.sum() / n.clamp_min(1)
    with torch.no_grad():
        pred = logits.argmax(-1)
        correct = (pred + d2t[pred] == top1[b, t]).sum()
    return loss, correct, loss_mask.sum(), n


def simulated_tau(acc: Sequence[float] | torch.Tensor) -> float:
    """Expected tokens per target step of a chain draft with per-step acceptance acc_k:
    tau = 1 + sum_k prod_{j<=k} acc_j (the 1 is the target's own token)."""
    acc = torch.as_tensor(acc, dtype=torch.float64)
    return float(1.0 + torch.cumprod(acc, 0).sum())


def add_uniform_noise(x: torch.Tensor, scale: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """x + U(-scale/2, scale/2). The official EAGLE-1 trainer draws (U(0,1)-0.5)*std*512/T with std=0.2,
    i.e. an amplitude that shrinks with the sequence length T; we keep the amplitude fixed at its T=512 value."""
    if scale <= 0:
        return x
    noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32) - 0.5
    return x + (noise * scale).to(x.dtype)


class _HeadSoftCrossEntropy(torch.autograd.Function):
    """sum over rows of soft-CE(pred @ W^T, softmax(target @ W^T)) through a FROZEN head W [V,H], in
    row chunks, fp32. The gradient w.r.t. pred, (softmax(z) - p) @ W, is formed chunk by chunk in forward,
    so no [N, V] tensor outlives its chunk: peak memory O(chunk x V) instead of ~4 x N x V (logits, teacher
    logits, teacher probs, gradient) with the same matmul count. Also returns the top-1 agreement count."""

    @staticmethod
    def forward(ctx, pred, target, weight, chunk_rows):
        w = weight.float()
        grad = torch.empty(pred.shape, dtype=torch.float32, device=pred.device)
        loss = torch.zeros((), dtype=torch.float32, device=pred.device)
        correct = torch.zeros((), dtype=torch.long, device=pred.device)
        for s in range(0, pred.shape[0], chunk_rows):
            z = pred[s : s + chunk_rows].float() @ w.T  # [c,V]
            zt = target[s : s + chunk_rows].float() @ w.T  # [c,V]
            correct += (z.argmax(-1) == zt.argmax(-1)).sum()
            p = zt.softmax(-1)
            lse = torch.logsumexp(z, dim=-1)
            loss += (lse - (p * z).sum(-1)).sum()
            grad[s : s + chunk_rows] = (torch.exp(z - lse[:, None]) - p) @ w  # d loss / d pred
        ctx.save_for_backward(grad)
        ctx.pred_dtype = pred.dtype
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss).to(ctx.pred_dtype), None, None, None


def head_soft_cross_entropy(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
                            chunk_rows: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """pred [N,H] (grad), target [N,H] (teacher features), weight [V,H] frozen lm_head
    -> (summed soft-CE over the N rows, fp32 scalar; rows whose argmax agrees, long scalar)."""
    return _HeadSoftCrossEntropy.apply(pred, target.detach(), weight.detach(), chunk_rows)


def eagle1_loss(
    head,
    batch: AlignedBatch,
    feature_weight: float = EAGLE1_FEATURE_WEIGHT,
    token_weight: float = EAGLE1_TOKEN_WEIGHT,
    noise_scale: float = 0.0,
    generator: Optional[torch.Generator] = None,
    chunk_rows: int = 1024,
) -> dict[str, torch.Tensor]:
    """EAGLE-1 objective: feature_weight * SmoothL1(predicted feature, next feature) + token_weight *
    soft-CE of the draft against the target distribution, both through the frozen target lm_head over
    the full vocabulary (computed in row chunks: head_soft_cross_entropy), masked and normalized by the
    number of loss-masked positions. `noise_scale` > 0 adds uniform noise to the input features (training
    only; the official trainer uses 0.2).

    Accuracy is single-step argmax agreement; multi-step acceptance of EAGLE-1 is measured by the tree
    decoder (eval), so `correct/total` gives only the first factor of the simulated tau.
    Returns loss, feature_loss, token_loss, correct, total (tensors; counts reduce by sum across ranks)."""
    mask = batch.loss_mask
    n = mask.sum()
    denom = n.clamp_min(1)
    feat = add_uniform_noise(head.fuse(batch.hidden), noise_scale, generator)
    # Left padding: pad keys hidden from real queries (positions already count from each row's first token).
    pred = head.forward_hidden(feat, batch.input_ids, batch.position_ids,
                               attn_mask=padded_causal_mask(batch.attention_mask))
    pred, target = pred[mask], batch.target_hidden[mask].to(pred.dtype)  # [N,H]
    feature_loss = F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1).sum() / denom
    token_sum, correct = head_soft_cross_entropy(pred, target, head.lm_head.weight, chunk_rows)
    token_loss = token_sum / denom
    return {
        "loss": feature_weight * feature_loss + token_weight * token_loss,
        "feature_loss": feature_loss.detach(),
        "token_loss": token_loss.detach(),
        "correct": correct,
        "total": n,
    }
