"""Draft heads: exported parameter names, architecture parity with HF Llama blocks, and the KV-cache /
tree-mask decoding path the tree decoder relies on."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from pipeline.heads import build_draft_head
from pipeline.heads.config import DraftHeadConfig
from pipeline.heads.eagle1 import Eagle1DraftHead
from pipeline.heads.eagle3 import Eagle3DraftHead
from pipeline.heads.layers import KVCache
from pipeline.heads.losses import add_uniform_noise, align_batch, eagle1_loss
from tests.support.heads import DRAFT_VOCAB, HEAD_DIM, HEADS, INTER, KV, VOCAB, H, make_head, tiny_config


def hf_llama_config() -> LlamaConfig:
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=256,
    )
    cfg._attn_implementation = "eager"
    return cfg


def test_eagle3_parameter_names_and_shapes():
    head = make_head("eagle3")
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    assert shapes == {
        "embed_tokens.weight": (VOCAB, H),
        "fc.weight": (H, 3 * H),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.k_proj.weight": (KV * HEAD_DIM, 2 * H),
        "midlayer.self_attn.v_proj.weight": (KV * HEAD_DIM, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (INTER, H),
        "midlayer.mlp.up_proj.weight": (INTER, H),
        "midlayer.mlp.down_proj.weight": (H, INTER),
        "norm.weight": (H,),
        "lm_head.weight": (DRAFT_VOCAB, H),
        "d2t": (DRAFT_VOCAB,),
        "t2d": (VOCAB,),
    }
    assert head.d2t.dtype == torch.long and head.t2d.dtype == torch.bool
    frozen = {n for n, p in head.named_parameters() if not p.requires_grad}
    assert frozen == {"embed_tokens.weight"}


@pytest.mark.parametrize("fc_bias", [False, True])
def test_eagle1_parameter_names_and_shapes(fc_bias):
    head = make_head("eagle1", fc_bias=fc_bias)
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    expected = {
        "embed_tokens.weight": (VOCAB, H),
        "fc.weight": (H, 2 * H),
        "layers.0.self_attn.q_proj.weight": (HEADS * HEAD_DIM, H),
        "layers.0.self_attn.k_proj.weight": (KV * HEAD_DIM, H),
        "layers.0.self_attn.v_proj.weight": (KV * HEAD_DIM, H),
        "layers.0.self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
        "layers.0.post_attention_layernorm.weight": (H,),
        "layers.0.mlp.gate_proj.weight": (INTER, H),
        "layers.0.mlp.up_proj.weight": (INTER, H),
        "layers.0.mlp.down_proj.weight": (H, INTER),
        "lm_head.weight": (VOCAB, H),
        "d2t": (VOCAB,),
        "t2d": (VOCAB,),
    }
    if fc_bias:
        expected["fc.bias"] = (H,)
    assert shapes == expected
    frozen = {n for n, p in head.named_parameters() if not p.requires_grad}
    assert frozen == {"embed_tokens.weight", "lm_head.weight"}
    assert bool(head.t2d.all()) and not bool(head.d2t.any())


def test_config_from_target_and_round_trip(tiny_model):
    cfg = DraftHeadConfig.from_target(tiny_model.config, "eagle3", draft_vocab_size=100, aux_layer_ids=None)
    t = tiny_model.config
    assert cfg.aux_layer_ids == [2, t.num_hidden_layers // 2, t.num_hidden_layers - 3]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 4, 2)
    assert cfg.head_dim == 16 and cfg.vocab_size == t.vocab_size and cfg.rope_theta == 10000.0
    assert DraftHeadConfig.from_dict(cfg.to_dict()) == cfg
    e1 = DraftHeadConfig.from_target(t, "eagle1", draft_vocab_size=None, aux_layer_ids=None, fc_bias=True)
    assert e1.draft_vocab_size == t.vocab_size and e1.aux_layer_ids == [] and e1.fc_bias
    with pytest.raises(ValueError):
        DraftHeadConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(ValueError):
        DraftHeadConfig(kind="eagle3", aux_layer_ids=[1, 2])


def test_copy_from_target(tiny_model):
    cfg = DraftHeadConfig.from_target(tiny_model.config, "eagle1", None, None)
    head = build_draft_head(cfg)
    head.copy_from_target(tiny_model)
    assert torch.equal(head.embed_tokens.weight, tiny_model.get_input_embeddings().weight)
    assert torch.equal(head.lm_head.weight, tiny_model.get_output_embeddings().weight)


def _causal_float_mask(t: int) -> torch.Tensor:
    return torch.full((t, t), float("-inf")).triu(1)[None, None]


def test_eagle1_layer_matches_hf_llama_layer_without_input_norm():
    """EAGLE-1's decoder layer is a Llama layer minus input_layernorm: same RoPE, GQA and SwiGLU."""
    head = make_head("eagle1")
    hf = LlamaDecoderLayer(hf_llama_config(), layer_idx=0).eval()
    hf.load_state_dict(head.layers[0].state_dict(), strict=False)
    hf.input_layernorm = torch.nn.Identity()
    torch.manual_seed(1)
    b, t = 2, 7
    hidden, ids = torch.randn(b, t, H), torch.randint(0, VOCAB, (b, t))
    pos = torch.arange(3, 3 + t).expand(b, t)
    out, logits = head(hidden, ids, pos)
    x = head.fc(torch.cat((head.embed_tokens(ids), hidden), dim=-1))  # embedding first, as cnets1.py
    rope = LlamaRotaryEmbedding(hf_llama_config())(x, pos)
    ref = hf(x, attention_mask=_causal_float_mask(t), position_embeddings=rope)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, head.lm_head(ref))
    assert logits.shape == (b, t, VOCAB)


def test_eagle3_attention_matches_hf_llama_attention():
    """EAGLE-3's midlayer = HF Llama attention over cat(input_layernorm(emb), hidden_norm(hidden)) with
    2H-wide q/k/v, residual on the raw hidden, then the usual post-norm SwiGLU block."""
    head = make_head("eagle3")
    layer = head.midlayer
    hf = LlamaDecoderLayer(hf_llama_config(), layer_idx=0).eval()
    hf.self_attn.q_proj, hf.self_attn.k_proj = layer.self_attn.q_proj, layer.self_attn.k_proj
    hf.self_attn.v_proj, hf.self_attn.o_proj = layer.self_attn.v_proj, layer.self_attn.o_proj
    hf.post_attention_layernorm, hf.mlp = layer.post_attention_layernorm, layer.mlp
    torch.manual_seed(2)
    b, t = 2, 6
    aux, ids = torch.randn(b, t, 3 * H), torch.randint(0, VOCAB, (b, t))
    pos = torch.arange(t).expand(b, t)
    hidden = head.fuse(aux)
    out, logits = head(hidden, ids, pos)
    x = torch.cat((layer.input_layernorm(head.embed_tokens(ids)), layer.hidden_norm(hidden)), dim=-1)
    rope = LlamaRotaryEmbedding(hf_llama_config())(x, pos)
    attn, _ = hf.self_attn(x, position_embeddings=rope, attention_mask=_causal_float_mask(t))
    h = hidden + attn
    ref = h + layer.mlp(layer.post_attention_layernorm(h))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, head.lm_head(head.norm(ref)))
    assert logits.shape == (b, t, DRAFT_VOCAB)


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_cached_decoding_matches_one_call(kind):
    head = make_head(kind)
    torch.manual_seed(3)
    b, t = 2, 9
    hidden, ids = torch.randn(b, t, H), torch.randint(0, VOCAB, (b, t))
    pos = torch.arange(t).expand(b, t)
    full_out, full_logits = head(hidden, ids, pos)

    cache = KVCache()
    steps = [head(hidden[:, i : i + 1], ids[:, i : i + 1], pos[:, i : i + 1], cache=cache) for i in range(t)]
    assert cache.length == t
    torch.testing.assert_close(torch.cat([o for o, _ in steps], 1), full_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([lg for _, lg in steps], 1), full_logits, rtol=1e-5, atol=1e-5)

    cache = KVCache()  # a prefix, then a chunk of several new tokens (causal among themselves)
    o1, _ = head(hidden[:, :4], ids[:, :4], pos[:, :4], cache=cache)
    o2, _ = head(hidden[:, 4:], ids[:, 4:], pos[:, 4:], cache=cache)
    torch.testing.assert_close(torch.cat([o1, o2], 1), full_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_tree_mask_matches_separate_branches(kind):
    """A draft tree root->{a1->a2, b1} in one masked call equals running each branch causally after the
    prefix; `keep` of the accepted branch leaves the same cache as running that branch alone."""
    head = make_head(kind)
    torch.manual_seed(4)
    b, p = 2, 5
    prefix_h, prefix_ids = torch.randn(b, p, H), torch.randint(0, VOCAB, (b, p))
    prefix_pos = torch.arange(p).expand(b, p)
    # tree nodes in order [a1, a2, b1]; a2 is a1's child; a1 and b1 are siblings at depth 0
    node_h, node_ids = torch.randn(b, 3, H), torch.randint(0, VOCAB, (b, 3))
    node_pos = torch.tensor([p, p + 1, p]).expand(b, 3)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(3, p, dtype=torch.bool), tree], 1)[None, None].expand(b, 1, 3, p + 3)

    cache = KVCache()
    head(prefix_h, prefix_ids, prefix_pos, cache=cache)
    tree_out, tree_logits = head(node_h, node_ids, node_pos, cache=cache, attn_mask=mask)
    assert cache.length == p + 3

    def branch(cols):
        c = KVCache()
        head(prefix_h, prefix_ids, prefix_pos, cache=c)
        out, logits = head(node_h[:, cols], node_ids[:, cols], node_pos[:, cols], cache=c)
        return out, logits, c

    a_out, a_logits, a_cache = branch([0, 1])
    b_out, b_logits, _ = branch([2])
    torch.testing.assert_close(tree_out[:, :2], a_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tree_out[:, 2:], b_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tree_logits[:, :2], a_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tree_logits[:, 2:], b_logits, rtol=1e-5, atol=1e-5)

    cache.keep(torch.tensor(list(range(p)) + [p, p + 1]))  # accept branch a
    torch.testing.assert_close(cache.keys[0], a_cache.keys[0])
    torch.testing.assert_close(cache.values[0], a_cache.values[0])
    cache.crop(p)
    assert cache.length == p


def test_kv_cache_keep_per_row():
    cache = KVCache()
    k = torch.arange(2 * 1 * 4 * 2, dtype=torch.float).view(2, 1, 4, 2)
    cache.append(0, k, -k)
    cache.keep(torch.tensor([[0, 3], [1, 2]]))
    torch.testing.assert_close(cache.keys[0], torch.stack([k[0, :, [0, 3]], k[1, :, [1, 2]]]))
    torch.testing.assert_close(cache.values[0], -cache.keys[0])


def test_heads_reject_wrong_kind():
    with pytest.raises(ValueError):
        Eagle3DraftHead(tiny_config("eagle1"))
    with pytest.raises(ValueError):
        Eagle1DraftHead(tiny_config("eagle3"))


def test_eagle1_loss_matches_plain_formula():
    """w_feat * SmoothL1(feature) + w_tok * soft-CE through the frozen lm_head, normalized by the number of
    positions whose predicted token (t+2) is loss-masked; accuracy = argmax agreement on those positions."""
    head = make_head("eagle1").train()
    torch.manual_seed(5)
    b, t = 2, 10
    valid = torch.ones(b, t, dtype=torch.long)
    valid[1, 7:] = 0
    ids = torch.randint(0, VOCAB, (b, t)) * valid
    loss_mask = (torch.rand(b, t) < 0.7).long() * valid
    final = torch.randn(b, t, H) * valid[..., None]
    out = eagle1_loss(head, align_batch(ids, loss_mask, final, final, valid), feature_weight=1.0, token_weight=0.1)

    n_ids = torch.cat([ids[:, 1:], torch.zeros(b, 1, dtype=torch.long)], 1)
    pred, logits = head(final, n_ids, torch.arange(t).expand(b, t))
    target = torch.cat([final[:, 1:], torch.zeros(b, 1, H)], 1)
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[:, : t - 2] = (loss_mask * valid)[:, 2:].bool()
    n = mask.sum()
    feat = (F.smooth_l1_loss(pred, target, reduction="none").mean(-1) * mask).sum() / n
    target_logits = head.lm_head(target)
    tok = (-(target_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1) * mask).sum() / n
    torch.testing.assert_close(out["feature_loss"], feat.detach())
    torch.testing.assert_close(out["token_loss"], tok.detach())
    torch.testing.assert_close(out["loss"], (feat + 0.1 * tok).detach())
    assert int(out["total"]) == int(n)
    assert int(out["correct"]) == int(((logits.argmax(-1) == target_logits.argmax(-1)) & mask).sum())

    out["loss"].backward()
    assert head.fc.weight.grad.abs().sum() > 0 and head.lm_head.weight.grad is None

    noisy = eagle1_loss(head, align_batch(ids, loss_mask, final, final, valid), noise_scale=0.2,
                        generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(noisy["loss"], out["loss"])


def fp32_soft_ce_error_bound(pred, target, weight):
    """A first-order forward error bound for soft-CE(pred @ W^T, softmax(target @ W^T)) and its gradient
    (softmax(z) - p) @ W when every step runs in fp32, whatever the BLAS summation order (Higham: an n-term
    dot product is off by at most gamma_n |a|.|b|, gamma_n = n u / (1 - n u), u = 2^-24). Computed in
    float64 from the data: returns (bound on the summed loss, elementwise bound on d loss / d pred).

    - logits: |dz| <= gamma_H |pred| |W|^T (and the same for the teacher's logits zt);
    - a softmax entry's relative error: both logits' shifts (2 max|dz|), the rounding of its exponent's
      argument (u (|z - lse| + |lse|)) and of the V-term normaliser ((V + 4) u);
    - gradient: the two softmaxes' errors times |W|, plus the V-term product's own gamma_V |s - p| |W|;
    - loss: the lse shift, p's and z's errors in sum_v p z, the V- and N-term sums.
    Doubled for the second-order terms."""
    u = 2.0**-24
    gamma = lambda n: n * u / (1 - n * u)  # noqa: E731
    P, T, W = pred.double(), target.double(), weight.double()
    V, H = W.shape
    z, zt = P @ W.T, T @ W.T
    ez, ezt = gamma(H) * P.abs() @ W.abs().T, gamma(H) * T.abs() @ W.abs().T
    s, p = z.softmax(-1), zt.softmax(-1)
    lse, lset = z.logsumexp(-1, keepdim=True), zt.logsumexp(-1, keepdim=True)
    rel_s = 2 * ez.amax(-1, keepdim=True) + u * ((z - lse).abs() + lse.abs()) + (V + 4) * u
    rel_p = 2 * ezt.amax(-1, keepdim=True) + u * ((zt - lset).abs() + lset.abs()) + (V + 4) * u
    grad = (rel_s * s + rel_p * p) @ W.abs() + gamma(V + 1) * (s - p).abs() @ W.abs()
    row_value = lse.squeeze(-1) - (p * z).sum(-1)
    row = (ez.amax(-1) + gamma(V + 2) * lse.squeeze(-1).abs() + (p * ez).sum(-1)
           + (rel_p * p * z.abs()).sum(-1) + gamma(V) * (p * z.abs()).sum(-1))
    loss = row.sum() + gamma(len(row)) * row_value.abs().sum()
    return 2 * loss, 2 * grad


@pytest.mark.parametrize("chunk_rows", [1, 3, 1024])
def test_chunked_head_soft_cross_entropy_matches_autograd_reference(chunk_rows):
    """The fused, chunked token loss (gradient formed in forward) equals plain autograd through
    soft-CE(pred @ W^T, softmax(target @ W^T)) computed in float64: value and d/d pred within the fp32
    rounding bound derived for these inputs (so any BLAS path passes and any real error fails), and the
    agreement count on every row whose top-2 logit margin exceeds that rounding."""
    from pipeline.heads.losses import head_soft_cross_entropy

    g = torch.Generator().manual_seed(1)
    pred = torch.randn(7, H, generator=g, requires_grad=True)
    target, weight = torch.randn(7, H, generator=g), torch.randn(VOCAB, H, generator=g)
    loss, correct = head_soft_cross_entropy(pred, target, weight, chunk_rows)
    (2.5 * loss).backward()
    ref_pred = pred.detach().double().requires_grad_(True)
    z, zt = ref_pred @ weight.double().T, target.double() @ weight.double().T
    ref = -(zt.softmax(-1) * z.log_softmax(-1)).sum()
    (2.5 * ref).backward()
    loss_bound, grad_bound = fp32_soft_ce_error_bound(pred.detach(), target, weight)
    assert abs(loss.double() - ref.detach()) <= loss_bound
    assert ((pred.grad.double() - ref_pred.grad).abs() <= 2.5 * grad_bound).all()
    # the bound is tight enough to mean something
    assert float(grad_bound.max()) < 1e-3 * float(ref_pred.grad.abs().max())
    margin = lambda x: x.topk(2, -1).values.diff(dim=-1).abs().squeeze(-1)  # noqa: E731
    decisive = (margin(z.detach()) > 1e-3) & (margin(zt) > 1e-3)
    agree = (z.detach().argmax(-1) == zt.argmax(-1))
    assert decisive.all() and int(correct) == int(agree.sum())


def test_uniform_noise_amplitude():
    x = torch.zeros(4000)
    noise = add_uniform_noise(x, 0.2, torch.Generator().manual_seed(0))
    assert noise.abs().max() <= 0.1 and noise.abs().max() > 0.09 and abs(float(noise.mean())) < 0.01
    assert add_uniform_noise(x, 0.0) is x


def test_eagle3_output_path_starts_as_the_targets(tiny_model):
    """lm_head_init=target: on the target's own last pre-norm state, the fresh head's logits are the target's
    logits at the draft-vocabulary ids, so training starts from the target's output map, not a random one."""
    import copy

    from pipeline.heads.vocab import vocab_from_ids

    tiny_model = copy.deepcopy(tiny_model)  # a final norm that is not all ones, so copying it is seen
    with torch.no_grad():
        tiny_model.model.norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    cfg = DraftHeadConfig.from_target(tiny_model.config, "eagle3", draft_vocab_size=40, aux_layer_ids=None)
    head = build_draft_head(cfg)
    head.copy_from_target(tiny_model)
    kept = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:40]
    head.set_draft_vocab(*vocab_from_ids(kept, cfg.vocab_size))
    random_logits_weight = head.lm_head.weight.clone()
    head.init_output_from_target(tiny_model)
    assert not torch.equal(head.lm_head.weight, random_logits_weight)

    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    seen = {}
    hook = tiny_model.model.norm.register_forward_pre_hook(lambda _, args: seen.update(pre_norm=args[0]))
    try:
        with torch.no_grad():
            target_logits = tiny_model(input_ids=ids).logits  # [1, 12, V]
    finally:
        hook.remove()
    draft_ids = head.draft_to_target(torch.arange(40))
    with torch.no_grad():
        torch.testing.assert_close(head.logits(seen["pre_norm"]), target_logits[..., draft_ids])

    rows_only = build_draft_head(cfg)  # lm_head_init=target_rows: the same rows, the norm left at 1
    rows_only.copy_from_target(tiny_model)
    rows_only.set_draft_vocab(head.d2t, head.t2d)
    rows_only.init_output_from_target(tiny_model, copy_norm=False)
    assert torch.equal(rows_only.lm_head.weight, head.lm_head.weight)
    assert torch.equal(rows_only.norm.weight, torch.ones_like(rows_only.norm.weight))
    assert not torch.equal(head.norm.weight, rows_only.norm.weight)
