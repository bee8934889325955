"""Stage export: the exact tensor list and config of each format (sglang, vllm, eagle1), each framework's
auxiliary-layer numbering, the tensor checker, and loading exports back into eaglet's tree decoder: an fp32
export gives exactly the checkpoint's logits, a bf16 export the same greedy tau."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, DynamicCache, LlamaConfig

from pipeline.decoding.decoder import generate, target_forward, vanilla_generate
from pipeline.decoding.drafter import EagleDrafter
from pipeline.export import formats as fmts
from pipeline.export.config import ExportConfig
from pipeline.export.exporter import (
    CONFIG,
    WEIGHTS,
    ExportError,
    check_export,
    export_head,
    load_export,
    max_logit_diff,
    model_architectures,
    tensor_infos,
)
from pipeline.export.formats.sglang import sglang_captured_layers, sglang_layers_agree
from pipeline.files import sha256_file
from pipeline.heads import build_draft_head, default_aux_layer_ids
from pipeline.heads.config import DraftHeadConfig
from pipeline.heads.vocab import vocab_from_ids
from pipeline.manifest import load_manifest, write_manifest
from tests.support.exports import (
    DRAFT_VOCAB,
    NUM_LAYERS,
    ROPE_THETA,
    VERIFIER,
    export,
    fake_train_stage,
    head_logits,
    make_head,
    prompts,
    read_config,
    stage_config,
)
from tests.support.paths import REPO

# The issue's tensor lists, written out independently of pipeline/export/formats/.
ATTN = [f"self_attn.{p}_proj.weight" for p in "qkvo"]
MLP = [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
EAGLE3_LAYER = ATTN + MLP + [f"{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")]
SGLANG_TENSORS = {f"midlayer.{n}" for n in EAGLE3_LAYER} | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
VLLM_TENSORS = {f"layers.0.{n}" for n in EAGLE3_LAYER} | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                                                           "embed_tokens.weight"}
EAGLE1_TENSORS = {f"layers.0.{n}" for n in ATTN + MLP + ["post_attention_layernorm.weight"]} | {
    "fc.weight", "embed_tokens.weight"}


pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------------------
# tensors


@pytest.mark.parametrize("fmt,kind,fc_bias,expected", [
    ("sglang", "eagle3", False, SGLANG_TENSORS),
    ("vllm", "eagle3", False, VLLM_TENSORS),
    ("eagle1", "eagle1", False, EAGLE1_TENSORS),
    ("eagle1", "eagle1", True, EAGLE1_TENSORS | {"fc.bias"}),
])
def test_each_format_holds_exactly_the_issue_tensors(tiny_model, tmp_path, fmt, kind, fc_bias, expected):
    out = export(make_head(tiny_model, kind, fc_bias=fc_bias), tmp_path / fmt, fmt, torch.bfloat16)
    infos = {t.name: t for t in check_export(out)}
    assert set(infos) == expected
    h, v = tiny_model.config.hidden_size, tiny_model.config.vocab_size
    shapes = {n: t.shape for n, t in infos.items()}
    if kind == "eagle3":
        assert shapes["fc.weight"] == (h, 3 * h) and shapes["lm_head.weight"] == (DRAFT_VOCAB, h)
        assert shapes["d2t"] == (DRAFT_VOCAB,) and shapes["t2d"] == (v,)
        assert infos["d2t"].dtype == "I64" and infos["t2d"].dtype == "BOOL"
        layer = "midlayer." if fmt == "sglang" else "layers.0."
        assert shapes[f"{layer}self_attn.q_proj.weight"] == (h, 2 * h)  # attention reads cat(emb, hidden)
    else:
        assert shapes["fc.weight"] == (h, 2 * h)
    if "embed_tokens.weight" in shapes:
        assert shapes["embed_tokens.weight"] == (v, h)
    assert {t.dtype for n, t in infos.items() if n not in ("d2t", "t2d")} == {"BF16"}


def rewrite(out: Path, edit) -> None:
    state = load_file(str(out / WEIGHTS))
    edit(state)
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})


@pytest.mark.parametrize("edit,message", [
    pytest.param(lambda s: s.update({"embed_tokens.weight": torch.zeros(384, 64)}),
                 "unexpected tensor embed_tokens.weight", id="extra-embedding"),
    pytest.param(lambda s: s.update({"midlayer.self_attn.rotary_emb.inv_freq": torch.zeros(8)}),
                 "unexpected tensor midlayer.self_attn.rotary_emb.inv_freq", id="extra-buffer"),
    pytest.param(lambda s: s.pop("t2d"), "missing tensor t2d", id="missing-t2d"),
    pytest.param(lambda s: s.pop("midlayer.hidden_norm.weight"), "missing tensor midlayer.hidden_norm.weight",
                 id="missing-norm"),
    pytest.param(lambda s: s.update({"fc.weight": s["fc.weight"][:, :128].contiguous()}),
                 "fc.weight: shape [64, 128], expected [64, 192]", id="shape"),
    pytest.param(lambda s: s.update({"norm.weight": s["norm.weight"].bfloat16()}),
                 "norm.weight: dtype BF16, expected F32", id="dtype"),
    pytest.param(lambda s: s.update({"d2t": s["d2t"] + 1}), "d2t and t2d disagree", id="vocab-maps"),
])
def test_checker_fails_on_any_extra_missing_misshapen_or_mistyped_tensor(tiny_model, tmp_path, edit, message):
    out = export(make_head(tiny_model), tmp_path / "sglang", "sglang")
    rewrite(out, edit)
    with pytest.raises(ExportError, match=message.replace("[", r"\[")):
        check_export(out)


def test_checker_fails_on_config_fields_the_loaders_misread(tiny_model, tmp_path):
    out = export(make_head(tiny_model), tmp_path / "vllm", "vllm")
    cfg = read_config(out)
    cfg["norm_before_residual"] = True  # vLLM would normalize the residual: a different network
    (out / CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="norm_before_residual must be false"):
        check_export(out)


# ---------------------------------------------------------------------------------------------------------
# configs


def test_sglang_config_declares_the_eagle3_architecture_with_trained_dimensions(tiny_model, tmp_path):
    head = make_head(tiny_model)
    out = export(head, tmp_path / "sglang", "sglang", torch.bfloat16)
    cfg, t = read_config(out), tiny_model.config
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert {k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size",
                                "target_hidden_size", "rms_norm_eps", "rope_theta", "torch_dtype")} == {
        "num_hidden_layers": 1, "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.hidden_size // t.num_attention_heads, "vocab_size": t.vocab_size,
        "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": t.hidden_size, "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": ROPE_THETA, "torch_dtype": "bfloat16"}
    assert "eagle_config" not in cfg  # default layers: both frameworks use their (identical) default
    # SGLang builds its config with transformers' AutoConfig: the fields it reads must survive that.
    hf = AutoConfig.from_pretrained(out)
    assert type(hf) is LlamaConfig and hf.architectures == ["LlamaForCausalLMEagle3"]
    assert hf.draft_vocab_size == DRAFT_VOCAB and hf.target_hidden_size == t.hidden_size
    assert hf.rope_parameters["rope_theta"] == ROPE_THETA and hf.tie_word_embeddings is False
    assert not getattr(hf, "bias", False)  # SGLang's fc reads `bias`, vLLM's attention too


def test_vllm_config_is_a_speculators_eagle3_config_naming_the_verifier(tiny_model, tmp_path):
    head = make_head(tiny_model)
    out = export(head, tmp_path / "vllm", "vllm", speculative_tokens=4)
    cfg = read_config(out)
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    assert cfg["norm_before_residual"] is False  # vLLM's speculators adapter defaults it to True
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["target_hidden_size"] == tiny_model.config.hidden_size
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 4, "verifier_accept_k": 1,
                                         "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": VERIFIER, "architectures": ["LlamaForCausalLM"]}
    layer = LlamaConfig(**cfg["transformer_layer_config"])  # what speculators/vLLM build the layer from
    assert (layer.num_hidden_layers, layer.vocab_size, layer.hidden_size) == (1, 384, 64)
    assert layer.rope_parameters["rope_theta"] == ROPE_THETA
    # The embedding travels in the file: the target's own, bit for bit.
    assert torch.equal(load_file(str(out / WEIGHTS))["embed_tokens.weight"], tiny_model.get_input_embeddings().weight)


def test_vllm_export_needs_a_verifier_and_formats_match_head_kinds(tiny_model, tmp_path):
    with pytest.raises(ExportError, match="names its verifier"):
        export_head(make_head(tiny_model), tmp_path / "v", "vllm", num_target_layers=NUM_LAYERS)
    with pytest.raises(ExportError, match="use eagle1"):
        export(make_head(tiny_model, "eagle1"), tmp_path / "s", "sglang")
    with pytest.raises(ExportError, match="use sglang or gguf or vllm"):
        export(make_head(tiny_model), tmp_path / "e", "eagle1")
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------------------
# auxiliary layers


def test_default_layers_are_omitted_for_sglang_and_spelled_out_for_vllm():
    assert default_aux_layer_ids(30) == [2, 15, 27]  # SmolLM2-135M
    cfg = DraftHeadConfig(aux_layer_ids=[2, 15, 27])
    ctx = fmts.ExportContext(num_target_layers=30, verifier=VERIFIER)
    assert "eagle_config" not in fmts.export_format("sglang").write_config(cfg, torch.bfloat16, ctx)
    written = fmts.export_format("vllm").write_config(cfg, torch.bfloat16, ctx)
    assert written["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]


@pytest.mark.parametrize("layers,convention,sglang_ids,agree", [
    ([2, 5, 6], "output", [1, 4, 5], True),  # layer 2 present: 1 first, read alike by every SGLang
    ([3, 5, 6], "output", [2, 4, 5], False),  # historic SGLang (+1 always) reads these right, #25454 does not
    ([3, 5, 6], "input", [3, 5, 6], False),  # SGLang with #25454 (as-is unless the first id is 1)
    ([1, 4, 6], "input", [4, 6, 1], False),  # input numbering never starts with 1
    ([0, 2, 7], "output", [1, -1, 6], True),  # the embedding output is SGLang's -1 (captured before layer 0)
])
def test_custom_aux_layers_are_written_in_each_framework_numbering(tiny_model, tmp_path, layers, convention,
                                                                   sglang_ids, agree):
    head = make_head(tiny_model, aux_layer_ids=layers)
    sglang = export(head, tmp_path / "sglang", "sglang", sglang_aux_convention=convention)
    vllm = export(head, tmp_path / "vllm", "vllm")
    written = read_config(sglang)["eagle_config"]
    assert written == {"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True}
    assert "eagle_aux_hidden_state_layer_ids" not in read_config(sglang)  # vLLM reads top-level ids as its own
    assert read_config(vllm)["eagle_aux_hidden_state_layer_ids"] == layers  # vLLM: input indices
    # What SGLang captures (its loop records the residual entering layer i for i in layers_to_capture):
    targeted = sglang_captured_layers(sglang_ids, after_pr_25454=convention == "input")
    assert targeted == layers
    assert sglang_layers_agree(sglang_ids) is agree
    for out, kw in ((sglang, {"sglang_aux_convention": convention}), (vllm, {})):
        assert load_export(out, tiny_model, **kw).config.aux_layer_ids == layers


def test_aux_layers_trained_out_of_order_are_exported_in_layer_order(tiny_model, tmp_path):
    """Frameworks concatenate the captured states in ascending layer order, so fc's column blocks follow."""
    head = make_head(tiny_model, aux_layer_ids=[6, 3, 5])
    loaded = load_export(export(head, tmp_path / "sglang", "sglang"), tiny_model)
    assert loaded.config.aux_layer_ids == [3, 5, 6]
    h = head.config.hidden_size
    blocks = head.fc.weight.view(h, 3, h)
    assert torch.equal(loaded.fc.weight, torch.cat([blocks[:, 1], blocks[:, 2], blocks[:, 0]], dim=1))
    assert max_logit_diff(head, loaded) < 1e-5  # same function; only the matmul summation order differs


@pytest.mark.parametrize("layers,message", [([2, 2, 5], "3 distinct"), ([2, 4, 8], "inputs 0..7")])
def test_unservable_aux_layers_are_refused(tiny_model, tmp_path, layers, message):
    with pytest.raises(ExportError, match=message):
        export(make_head(tiny_model, aux_layer_ids=layers), tmp_path / "sglang", "sglang")


# ---------------------------------------------------------------------------------------------------------
# loading back into eaglet's decoder


@pytest.mark.parametrize("fmt,kind,fc_bias", [("sglang", "eagle3", False), ("vllm", "eagle3", False),
                                              ("eagle1", "eagle1", False), ("eagle1", "eagle1", True)])
def test_fp32_export_loads_back_with_exactly_the_checkpoint_logits(tiny_model, tmp_path, fmt, kind, fc_bias):
    head = make_head(tiny_model, kind, fc_bias=fc_bias)
    loaded = load_export(export(head, tmp_path / fmt, fmt), tiny_model)
    assert loaded.config == head.config
    prompt = prompts(tiny_model.config.vocab_size)[0]
    torch.testing.assert_close(head_logits(loaded, tiny_model, prompt), head_logits(head, tiny_model, prompt),
                               atol=0, rtol=0)
    # And through the tree decoder: the same trees, hence the same accepted lengths.
    a, b = (generate(tiny_model, EagleDrafter(h), prompt, 24, eos_token_ids=()) for h in (head, loaded))
    assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths


@pytest.fixture(scope="module")
def distilled_head(tiny_model):
    """An EAGLE-3 head fitted (one-step teacher forcing) to the target's greedy continuations of the test
    prompts: greedy tree decoding then accepts several tokens per step, so tau is worth comparing."""
    seqs = [torch.cat([p, torch.tensor(vanilla_generate(tiny_model, p, 40, eos_token_ids=()).tokens)])
            for p in prompts(tiny_model.config.vocab_size)]
    vocab = torch.unique(torch.cat(seqs))
    cfg = DraftHeadConfig.from_target(tiny_model.config, "eagle3", draft_vocab_size=len(vocab), aux_layer_ids=None,
                                      rope_theta=ROPE_THETA)
    torch.manual_seed(0)
    head = build_draft_head(cfg)
    head.copy_from_target(tiny_model)
    d2t, t2d = vocab_from_ids(vocab, cfg.vocab_size)
    head.set_draft_vocab(d2t, t2d)
    draft_id = torch.cumsum(t2d.long(), 0) - 1  # target id -> draft id (kept ids in ascending order)
    with torch.no_grad():
        states = [target_forward(tiny_model, s[None], DynamicCache(config=tiny_model.config), cfg.aux_layer_ids)[1]
                  for s in seqs]
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(150):
        for seq, st in zip(seqs, states):
            # state of token t and token t+1 -> token t+2
            _, logits = head(head.fuse(st[None, :-2]), seq[None, 1:-1], torch.arange(len(seq) - 2)[None])
            loss = F.cross_entropy(logits[0], draft_id[seq[2:]])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return head.eval()


def test_bf16_export_gives_the_same_greedy_tau(tiny_model, tmp_path, distilled_head):
    loaded = load_export(export(distilled_head, tmp_path / "sglang", "sglang", torch.bfloat16), tiny_model)
    assert loaded.fc.weight.dtype == torch.float32 and max_logit_diff(distilled_head, loaded) > 0  # rounded
    for prompt in prompts(tiny_model.config.vocab_size):
        ref, got = (generate(tiny_model, EagleDrafter(h), prompt, 40, eos_token_ids=())
                    for h in (distilled_head, loaded))
        assert ref.tau > 1.5  # a head that drafts, or the comparison would be vacuous
        assert got.tau == ref.tau and got.tokens == ref.tokens


# ---------------------------------------------------------------------------------------------------------
# the stage


def test_stage_exports_verifies_and_prints_the_serve_commands(tiny_model, tiny_model_dir, tmp_path, capsys):
    from pipeline.export.run import main

    cfg = stage_config(tmp_path, tiny_model_dir, verify=True)
    train_dir = fake_train_stage(cfg, make_head(tiny_model))
    out = main(cfg)
    assert out == cfg.stage_dir("export") / "sglang"
    printed = capsys.readouterr().out
    assert "midlayer.hidden_norm.weight" in printed and "BF16" in printed  # the tensor table
    assert "round trip (bfloat16)" in printed
    path = str(out.resolve())
    assert (f"python -m sglang.launch_server --model {VERIFIER} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {path} --speculative-num-steps 6 --speculative-eagle-topk 10 "
            f"--speculative-num-draft-tokens 60") in printed
    assert f"""vllm serve {VERIFIER} --speculative-config '{{"model": "{path}", "method": "eagle3", """ \
           f""""num_speculative_tokens": 3}}'""" in printed
    manifest = load_manifest(out, expect_stage="export")
    assert manifest["format"] == "sglang" and manifest["counts"]["tensors"] == len(SGLANG_TENSORS)
    assert manifest["inputs"] == [{"path": str(train_dir), "manifest_sha256": sha256_file(train_dir / "manifest.json")}]
    assert {t.name for t in tensor_infos(out)} == SGLANG_TENSORS

    cfg.export = ExportConfig(format="vllm", dtype="float32", verify=True)
    out = main(cfg)
    printed = capsys.readouterr().out
    assert out.name == "vllm" and "max |logits(export) - logits(checkpoint)| = 0" in printed
    assert "vllm serve" in printed and "export.format=sglang" in printed


def test_a_committed_head_gets_a_model_card_from_its_export_and_the_results_store(tiny_model, tiny_model_dir,
                                                                                   tmp_path):
    import shutil

    from pipeline.export.run import main
    from pipeline.manifest import ManifestError
    from pipeline.results import main as results_main
    from pipeline.target import load_target
    from pipeline.train.config import TrainConfig

    cfg = stage_config(tmp_path / "outputs", tiny_model_dir)
    train_dir = fake_train_stage(cfg, make_head(tiny_model))
    write_manifest(train_dir, "train", config={"train": TrainConfig(epochs=3, select="tau", tau_prompts=8),
                                               "dump": {"input": "regen"}},
                   counts={"train_rows": 2523, "val_rows": 133, "train_tokens": 2_160_000, "steps": 1728,
                           "world_size": 1, "draft_vocab_size": 200, "coverage": 0.9991},
                   timings={"total_s": 5400}, target=load_target(cfg.target).fingerprint, precision="bfloat16",
                   selected={"step": 1400, "tau": 2.31, "last_step": 1728}, machine="AMD EPYC, 2 threads",
                   # rebuilt on this machine from the complete carry of a run trained elsewhere (train/carry.py)
                   carries=[{"step": 1728, "complete": True, "train_manifest_sha256": "1" * 64}])
    out = main(cfg)
    head_dir = tmp_path / "heads" / "tiny-eagle3"  # what a campaign commits: the export's files and manifest
    head_dir.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "manifest.json"):
        shutil.copy2(out / name, head_dir / name)
    store = tmp_path / "results" / "t"  # a results store: the train manifest and the evals, as `save` keeps them
    (store / "train" / "eagle3").mkdir(parents=True)
    shutil.copy2(train_dir / "manifest.json", store / "train" / "eagle3" / "manifest.json")
    summary = {"tau": 2.4, "acceptance_by_depth": [0.6, 0.4, 0.3], "turns": 160, "questions": 80, "questions_done": 80,
               "spec_tokens_per_s": 50.0, "baseline_tokens_per_s": 30.0, "speedup": 1.67, "baseline_turns": 20,
               "settings": {"depth": 6, "top_k": 10, "total_tokens": 60, "temperature": 0},
               "machine": "Intel(R) Xeon(R) Processor (amx_bf16, avx512_bf16), 2 threads",
               "head_manifest_sha256": sha256_file(train_dir / "manifest.json")}
    for run, s in {"mt_bench-n80-T0-m256-bfloat16-tree10x6x60": summary,
                   # an eval of another train run of the same name (trained again since): not this head's
                   "mt_bench-n40-T0-m128-bfloat16-tree10x6x60": {**summary, "tau": 9.0,
                                                                  "head_manifest_sha256": "0" * 64},
                   # an eval of the run the head was carried from: this head (the same weights in bf16)
                   "mt_bench-n20-T1-m256-bfloat16-tree10x6x60": {**summary, "tau": 2.2, "questions": 20,
                                                                  "questions_done": 20,
                                                                  "head_manifest_sha256": "1" * 64}}.items():
        (store / "eval" / "eagle3" / run).mkdir(parents=True)
        (store / "eval" / "eagle3" / run / "summary.json").write_text(json.dumps(s))

    results_main(["card", str(head_dir), str(store)])
    card = (head_dir / "README.md").read_text()
    assert "no eval of this folder has checked its outputs yet" in card  # nothing claimed that was not checked
    # The folder as shipped, evaluated by eval.head_dir (under its folder's name, naming its manifest): first, and
    # what its greedy check proved is what the card claims.
    shipped = {**summary, "tau": 1.9, "settings": {**summary["settings"], "dtype": "float32"},
               "head_manifest_sha256": sha256_file(head_dir / "manifest.json"), "tau_per_turn": {"1": 2.0, "2": 1.8},
               "greedy_check": {"precision": "float32", "turns": 160, "on_greedy_path": 160, "partings": 0, "ties": 0}}
    (store / "eval" / head_dir.name / "mt_bench-T0-m256-float32-tree10x6x60").mkdir(parents=True)
    (store / "eval" / head_dir.name / "mt_bench-T0-m256-float32-tree10x6x60" / "summary.json").write_text(
        json.dumps(shipped))
    results_main(["card", str(head_dir), str(store)])
    card = (head_dir / "README.md").read_text()
    assert "in fp32 160 of 160 turns were the target's greedy output token for token." in card
    rows = [line for line in card.splitlines() if line.startswith(("| eagle3 |", "| tiny-eagle3 |"))]
    assert rows[0] == ("| tiny-eagle3 | mt_bench | 0 | float32 | 80/80 | 160 | **1.90** | 2.00 / 1.80 | 160/160 | "
                       "0.60 0.40 0.30 | 1.67x (20 turns) | 50.0 / 30.0 | 6, 10, 60 |")
    assert card.startswith(f"---\nbase_model: {VERIFIER}\n")
    assert sha256_file(head_dir / "model.safetensors")[:16] in card
    assert "2,523 conversations, 2,160,000 tokens per epoch, the target's own answers" in card
    assert "step 1400 of 1728, the best decoded tau (2.31) of the probes on 8 validation prompts" in card
    # the manifest's machine rebuilt the head and trained nothing; a carry older than its machine record names the
    # carried run's manifest instead
    assert ("trained on the machine its train manifest 111111111111 names; rebuilt on AMD EPYC, 2 threads from its "
            "complete carry (no step trained there) in bfloat16") in card
    assert "| eagle3 | mt_bench-n80 | 0 | bfloat16 | 80/80 | 160 | **2.40** | - | - |" in card
    assert "**9.00**" not in card and "**2.20**" in card and "2 threads" in card
    assert f"--speculative-draft-model-path {head_dir} --speculative-num-steps 6" in card  # served from its folder

    from pipeline.results import trained_on
    carried = {"counts": {"steps": 1728}, "machine": "AMD EPYC, 2 threads",
               "carries": [{"step": 1728, "complete": True, "train_manifest_sha256": "1" * 64,
                            "machine": "NVIDIA H200"}]}
    assert trained_on(carried).startswith("trained on NVIDIA H200; rebuilt on AMD EPYC, 2 threads")
    carried["carries"][0]["complete"] = False  # a run carried mid-way and trained on here: this machine's steps
    assert trained_on(carried) == "trained on AMD EPYC, 2 threads"

    manifest = store / "train" / "eagle3" / "manifest.json"  # the store's run is not the exported one
    manifest.write_text(manifest.read_text().replace('"steps": 1728', '"steps": 1729'))
    with pytest.raises(ValueError, match="not the train run"):
        results_main(["card", str(head_dir), str(store)])
    (head_dir / "model.safetensors").write_bytes(b"\0" + (head_dir / "model.safetensors").read_bytes()[1:])
    with pytest.raises(ManifestError, match="model.safetensors"):  # not the export the manifest describes
        results_main(["card", str(head_dir), str(store)])


def test_stage_refuses_a_format_of_the_other_head_kind(tiny_model, tiny_model_dir, tmp_path):
    from pipeline.export.run import main

    cfg = stage_config(tmp_path, tiny_model_dir, kind="eagle1", format="sglang")
    fake_train_stage(cfg, make_head(tiny_model, "eagle1"))
    with pytest.raises(ExportError, match="use eagle1"):
        main(cfg)
    assert not cfg.stage_dir("export").exists()


def test_cli_runs_the_stage(tiny_model, tiny_model_dir, tmp_path):
    """`python -m pipeline.run stage=export ...` through Hydra, as `make demo` runs it."""
    fake_train_stage(stage_config(tmp_path, tiny_model_dir), make_head(tiny_model))
    cmd = [sys.executable, "-m", "pipeline.run", "stage=export", "target=hf", f"target.path={tiny_model_dir}",
           "target.name=tiny", f"target.hub_id={VERIFIER}", "name=t", f"output_root={tmp_path}",
           "export.format=vllm", "export.dtype=float32"]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = tmp_path / "t" / "export" / "eagle3" / "vllm"
    assert f"export (vllm, float32): {out.resolve()}" in run.stdout
    assert f"vllm serve {VERIFIER} --speculative-config" in run.stdout
    assert {t.name for t in check_export(out)} == VLLM_TENSORS


@pytest.mark.slow
def test_smollm2_sized_head_exports_exactly(smollm2, tmp_path):
    """At the real target's dimensions (30 layers, H 576, vocab 49152): default layers [2, 15, 27] left to the
    frameworks by the sglang format and spelled out by the vllm one; an fp32 export decodes identically."""
    model = smollm2.model
    head = make_head(model)
    assert head.config.aux_layer_ids == [2, 15, 27]
    prompt = smollm2.tokenizer("The lighthouse keeper", return_tensors="pt").input_ids[0]
    reference = generate(model, EagleDrafter(head), prompt, 12, eos_token_ids=())
    for fmt in ("sglang", "vllm"):
        out = export_head(head, tmp_path / fmt, fmt, torch.float32, num_target_layers=30,
                          verifier=smollm2.fingerprint["hub_id"], verifier_architectures=model_architectures(model))
        cfg = read_config(out)
        if fmt == "sglang":
            assert "eagle_config" not in cfg
        else:
            assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
            assert cfg["speculators_config"]["verifier"] == {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                             "architectures": ["LlamaForCausalLM"]}
        result = generate(model, EagleDrafter(load_export(out, smollm2)), prompt, 12, eos_token_ids=())
        assert result.tokens == reference.tokens and result.accept_lengths == reference.accept_lengths


def test_a_killed_exports_temporary_is_removed_by_the_next_export(tiny_model, tmp_path):
    out = tmp_path / "sglang"
    stale = tmp_path / ".sglang.99999.tmp"  # what a kill -9 inside the write leaves (bench/faults.py saw it)
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    export(make_head(tiny_model), out, "sglang")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sglang"]


def test_the_carried_runs_machine_comes_from_the_manifest_git_keeps(tmp_path):
    """A head rebuilt from an older carry (no machine recorded) replaced its run's train manifest in the store; the
    card finds the carried run's machine in the version of that manifest whose sha256 the carry names."""
    from pipeline.results import manifest_machine, trained_on

    path = tmp_path / "store" / "train" / "eagle3" / "manifest.json"
    path.parent.mkdir(parents=True)

    def commit(machine: str) -> str:
        path.write_text(json.dumps({"stage": "train", "machine": machine}))
        git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", machine], check=True)
        return sha256_file(path)

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    carried_run = commit("Intel Xeon (amx_bf16)")
    commit("AMD EPYC (avx512_bf16)")  # the rebuild's manifest, saved over it
    assert manifest_machine(path, carried_run) == "Intel Xeon (amx_bf16)"
    assert manifest_machine(path, "0" * 64) is None  # no version of it is the carried run's
    rebuilt = {"counts": {"steps": 8}, "machine": "AMD EPYC (avx512_bf16)",
               "carries": [{"step": 8, "complete": True, "train_manifest_sha256": carried_run}]}
    assert trained_on(rebuilt, path).startswith("trained on Intel Xeon (amx_bf16); rebuilt on AMD EPYC")
    outside = tmp_path.parent / f"{tmp_path.name}-bare" / "manifest.json"
    outside.parent.mkdir()
    assert manifest_machine(outside, carried_run) is None  # not in a git checkout
