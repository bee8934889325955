"""EAGLE-3.1's two head options (`head.fc_norm`, `head.norm_output`): what they change in the head, that training
and tree decoding run with them losslessly, and that both export dialects carry them (config keys and
`fc_norm.{i}` tensors) and round-trip exactly, aux layers reordered included."""
from __future__ import annotations

import pytest
import torch

from pipeline.decoding.decoder import generate
from pipeline.decoding.drafter import EagleDrafter
from pipeline.decoding.tree import TreeSpec
from pipeline.export.exporter import check_export, load_export, max_logit_diff
from pipeline.heads.config import DraftHeadConfig
from pipeline.heads.losses import align_batch
from pipeline.heads.ttt import ttt_forward
from tests.support.decoding import QUESTIONS, chat_ids, hf_greedy
from tests.support.exports import export, head_logits, make_head, prompts, read_config

pytestmark = pytest.mark.usefixtures("single_thread")
BOTH = dict(fc_norm=True, norm_output=True)


def test_fc_norm_normalizes_each_fused_state_before_fc(tiny_model):
    head = make_head(tiny_model, fc_norm=True)
    h = head.config.target_hidden_size
    states = torch.randn(1, 5, 3 * h)
    parts = [n(c) for n, c in zip(head.fc_norm, states.split(h, dim=-1))]
    torch.testing.assert_close(head.fuse(states), head.fc(torch.cat(parts, dim=-1)))
    # Scaling one layer's state changes nothing: each is normalized on its own.
    scaled = torch.cat([states[..., :h] * 7.0, states[..., h:]], dim=-1)
    torch.testing.assert_close(head.fuse(scaled), head.fuse(states), rtol=1e-5, atol=1e-5)


def test_norm_output_feeds_the_normed_state_to_the_next_round(tiny_model):
    plain, eagle31 = make_head(tiny_model, seed=3), make_head(tiny_model, seed=3, norm_output=True)
    eagle31.load_state_dict(plain.state_dict())
    t, h = 6, plain.config.target_hidden_size
    gen = torch.Generator().manual_seed(0)
    batch = align_batch(torch.randint(0, 300, (1, t), generator=gen), torch.ones(1, t, dtype=torch.long),
                        torch.randn(1, t, 3 * h, generator=gen), torch.randn(1, t, h, generator=gen),
                        torch.ones(1, t, dtype=torch.long))
    a, b = list(ttt_forward(plain, batch, 2)), list(ttt_forward(eagle31, batch, 2))
    torch.testing.assert_close(b[0], plain.norm(a[0]))  # round 0: the same layer, normed once
    torch.testing.assert_close(eagle31.logits(b[0]), plain.logits(a[0]))  # and the same logits
    assert not torch.allclose(b[1], plain.norm(a[1]), atol=1e-4)  # round 1 read another hidden


def test_the_options_belong_to_heads_that_fuse_target_layers(tiny_model):
    with pytest.raises(ValueError, match="EAGLE-3.1 options"):
        DraftHeadConfig.from_target(tiny_model.config, "eagle1", None, None, norm_output=True)


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
@pytest.mark.parametrize("layers", [None, [6, 3, 5]], ids=["default-layers", "reordered-layers"])
def test_exports_carry_the_options_and_round_trip_exactly(tiny_model, tmp_path, fmt, layers):
    head = make_head(tiny_model, aux_layer_ids=layers, **BOTH)
    out = export(head, tmp_path / fmt, fmt)
    cfg = read_config(out)
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= {t.name for t in check_export(out)}
    loaded = load_export(out, tiny_model)
    assert loaded.config.fc_norm and loaded.config.norm_output
    if layers is None:
        assert loaded.config == head.config and max_logit_diff(head, loaded) == 0
        prompt = prompts(tiny_model.config.vocab_size)[0]
        torch.testing.assert_close(head_logits(loaded, tiny_model, prompt), head_logits(head, tiny_model, prompt),
                                   atol=0, rtol=0)
    else:  # fc blocks and their norms moved to layer order [3, 5, 6]: the same function
        assert torch.equal(loaded.fc_norm[0].weight, head.fc_norm[1].weight)
        assert torch.equal(loaded.fc_norm[2].weight, head.fc_norm[0].weight)
        assert max_logit_diff(head, loaded) < 1e-5


def test_a_plain_eagle3_export_names_neither_option(tiny_model, tmp_path):
    cfg = read_config(export(make_head(tiny_model), tmp_path / "sglang", "sglang"))
    assert "fc_norm" not in cfg and "norm_output" not in cfg


def test_tree_decoding_with_an_eagle31_head_is_lossless(tiny_model, tiny_tokenizer):
    head = make_head(tiny_model, **BOTH)
    prompt = chat_ids(tiny_tokenizer, QUESTIONS[0])
    result = generate(tiny_model, EagleDrafter(head), prompt, 32, tree=TreeSpec(4, 3, 12), eos_token_ids=())
    assert result.tokens == hf_greedy(tiny_model, prompt, 32)
