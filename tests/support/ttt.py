"""The plain EAGLE-3 training-time test written straight from the spec (dense masks over every round's keys,
full-vocabulary log-softmax): the reference test_ttt.py holds the efficient TTT to, and bench/bench_ttt.py times
it against."""
from __future__ import annotations

import math

import torch


def _rope(x, pos, theta):
    """Llama rotate_half RoPE, written independently of the heads' implementation."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None, :, None].float() * torch.cat([inv, inv])  # [B,1,T,D]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()


def reference_ttt_loss(head, input_ids, loss_mask, aux_hidden, final_hidden, attention_mask, lm_head_w,
                       steps, decay=0.8):
    """Plain EAGLE-3 TTT: dense [T, (i+1)T] masks over the keys of all rounds, full-vocabulary log-softmax.

    Round i, position t: state of tokens <= t (fc at round 0, else round i-1's output), embedding of
    token t+1+i, RoPE position pos[t]+i, predicts token t+2+i against softmax(lm_head(final[t+1+i]))
    restricted to the draft vocab; loss mask of token t+2+i; keys: round 0 at s <= t, rounds 1..i at t."""
    b, t = input_ids.shape
    valid = attention_mask.bool()
    pos = (valid.long().cumsum(1) - 1).clamp_min(0)
    layer, attn, cfg = head.midlayer, head.midlayer.self_attn, head.config
    groups, head_dim = cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
    target_logits = (final_hidden @ lm_head_w.T).float()  # [B,T,V]: state s predicts token s+1
    eye = torch.eye(t, dtype=torch.bool)
    block0 = (torch.ones(t, t, dtype=torch.bool).tril() & valid[:, None, :]) | eye  # [B,T,T]
    hidden, keys, values, total = head.fc(aux_hidden), [], [], 0.0
    round_loss, round_correct, round_total = [], [], []
    for i in range(steps):
        ids = torch.zeros_like(input_ids)
        ids[:, : max(t - 1 - i, 0)] = input_ids[:, 1 + i :]
        x = torch.cat([layer.input_layernorm(head.embed_tokens(ids)), layer.hidden_norm(hidden)], -1)
        q = attn.q_proj(x).view(b, t, -1, head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, -1, head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, -1, head_dim).transpose(1, 2)
        q, k = _rope(q, pos + i, cfg.rope_theta), _rope(k, pos + i, cfg.rope_theta)
        keys.append(k.repeat_interleave(groups, 1))
        values.append(v.repeat_interleave(groups, 1))
        mask = torch.cat([block0] + [eye.expand(b, t, t)] * i, dim=-1)[:, None]  # [B,1,T,(i+1)T]
        scores = q @ torch.cat(keys, 2).transpose(-1, -2) / math.sqrt(head_dim)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        o = (probs @ torch.cat(values, 2)).transpose(1, 2).reshape(b, t, -1)
        h = hidden + attn.o_proj(o)
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        logp = head.lm_head(head.norm(out)).float().log_softmax(-1)

        tl = torch.zeros_like(target_logits)  # target logits for token t+2+i
        tl[:, : max(t - 1 - i, 0)] = target_logits[:, 1 + i :]
        top1 = tl.argmax(-1)
        p = tl[..., head.t2d].softmax(-1)
        lm = torch.zeros_like(valid)
        lm[:, : max(t - 2 - i, 0)] = (loss_mask.bool() & valid)[:, 2 + i :]
        lm &= valid
        counted = lm & head.t2d[top1]
        ce = -(p * logp).sum(-1)
        loss_i = (ce * counted).sum() / counted.sum().clamp_min(1)
        pred = logp.argmax(-1)
        round_loss.append(loss_i)
        round_correct.append(((pred + head.d2t[pred] == top1) & counted).sum())
        round_total.append(lm.sum())
        total = total + decay**i * loss_i
        hidden = out
    return total, torch.stack(round_loss), torch.stack(round_correct), torch.stack(round_total)
