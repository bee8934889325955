"""The export doctor (pipeline/export/doctor.py, `python -m pipeline.doctor`): a good export passes, and each
silent mismatch seen in the field, built into an otherwise good export, is named in one line (file, key, reason)
with a non-zero exit. The exports come from the export stage itself (`main`) over a fake train stage holding a
briefly fitted head, so the manifest names the training checkpoint the doctor compares with."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from pipeline.config import EagletConfig, TargetConfig
from pipeline.decoding.decoder import target_forward
from pipeline.doctor import main as doctor_main
from pipeline.export.config import ExportConfig
from pipeline.export.doctor import PROBLEM, WARNING, diagnose, fresh_init_evidence
from pipeline.export.exporter import CONFIG, WEIGHTS
from pipeline.heads import head_config
from pipeline.manifest import MANIFEST, file_digests
from tests.support.exports import VERIFIER, fake_train_stage, make_head
from tests.support.paths import REPO

pytestmark = pytest.mark.usefixtures("single_thread")


def fit(head, model, steps: int = 25, seed: int = 0):
    """A few Adam steps on the target's real states towards random draft tokens: every trained matrix leaves its
    initialisation (what any training does), nothing more is asked of the head here."""
    layers = list(head.config.aux_layer_ids) or [-1]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, head.config.vocab_size, (1, 24), generator=gen)
    with torch.no_grad():
        _, states = target_forward(model, ids, DynamicCache(config=model.config), layers)
    labels = torch.randint(0, head.config.draft_vocab_size, (23,), generator=gen)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        _, logits = head(head.fuse(states[None, :-1]), ids[:, 1:], torch.arange(23)[None])
        loss = F.cross_entropy(logits[0], labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def target_cfg(model_dir: Path, name: str = "tiny") -> TargetConfig:
    return TargetConfig(name=name, path=str(model_dir), gguf_package=None, gguf_file=None, hub_id=VERIFIER,
                        device="cpu", dtype="float32")


def stage(root: Path, target: TargetConfig, head, formats=("sglang",), **export_kw) -> dict:
    """The export stage over a fake train stage holding `head`: {format: export dir}."""
    from pipeline.export.run import main

    cfg = EagletConfig(stage="export", name="t", output_root=str(root), target=target,
                       head=head_config(head.config.kind))
    fake_train_stage(cfg, head)
    out = {}
    for fmt in formats:
        cfg.export = ExportConfig(format=fmt, **export_kw)
        out[fmt] = main(cfg)
    return out


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    from pipeline.target import load_target

    return load_target(target_cfg(tiny_model_dir))


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_model, tiny_model_dir):
    """Good bf16 sglang and vllm exports of one fitted EAGLE-3 head (default layers [2, 4, 5], rope_theta
    500000 as tests/support/exports.py's heads)."""
    head = fit(make_head(tiny_model), tiny_model)
    return stage(tmp_path_factory.mktemp("stage"), target_cfg(tiny_model_dir), head, formats=("sglang", "vllm"))


def copy(src: Path, dst: Path) -> Path:
    """A private copy of a good export (its manifest still names the same training checkpoint)."""
    shutil.copytree(src, dst)
    return dst


def tamper(out: Path, config=None, state=None) -> Path:
    """Edits an export in place as a buggy exporter would have written it: `config(dict)` and `state(dict)` edit
    config.json and the tensors, and the manifest records the edited files' digests."""
    if config is not None:
        doc = json.loads((out / CONFIG).read_text())
        config(doc)
        (out / CONFIG).write_text(json.dumps(doc, indent=2) + "\n")
    if state is not None:
        tensors = load_file(str(out / WEIGHTS))
        state(tensors)
        save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"] = file_digests(out, list(manifest["files"]))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def problems(diagnosis) -> list[str]:
    return [str(f) for f in diagnosis.findings if f.severity == PROBLEM]


def named(diagnosis, file: str, key: str, *words: str) -> str:
    """The one problem line about `key` in `file`, checked to give the reason (`words`)."""
    lines = [str(f) for f in diagnosis.findings if f.severity == PROBLEM and f.file == file and f.key == key]
    assert lines, f"no problem about {file}: {key} in:\n{diagnosis.report()}"
    assert any(all(w in line for w in words) for line in lines), "\n".join(lines)
    return lines[0]


# ---------------------------------------------------------------------------------------------------------
# healthy


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_a_good_export_is_healthy_and_every_loader_agrees_with_the_training_forward(exports, target, fmt, capsys):
    diagnosis = diagnose(exports[fmt], target)
    assert diagnosis.healthy, diagnosis.report()
    assert problems(diagnosis) == []
    assert diagnosis.reference == "the training forward"
    (run,) = diagnosis.runs
    assert run.name == "load_export" and run.first_divergence is None and run.refused is None
    # the TTT unroll's first two rounds: what the next draft step is fed is compared too
    assert [s.stage for s in run.stages] == ["embed", "fc", "midlayer", "norm", "logits", "midlayer, step 2",
                                             "norm, step 2", "logits, step 2"]
    assert all(abs(s.norm_ratio - 1) < 1e-2 for s in run.stages)
    assert run.top1[0] >= 0.8 * run.top1[1]
    report = diagnosis.report()
    assert "healthy: 0 problems" in report and "first divergence" in report
    assert doctor_main([str(exports[fmt])]) == 0
    assert "healthy: 0 problems" in capsys.readouterr().out



def test_a_good_eagle1_export_is_healthy_and_its_embedding_is_held_to_the_targets(tiny_model, tiny_model_dir, target,
                                                                                  tmp_path):
    head = fit(make_head(tiny_model, "eagle1"), tiny_model)
    good = stage(tmp_path / "stage", target_cfg(tiny_model_dir), head, formats=("eagle1",))["eagle1"]
    diagnosis = diagnose(good, target)
    assert diagnosis.healthy, diagnosis.report()
    assert [s.stage for s in diagnosis.runs[0].stages] == ["embed", "fc", "layers.0", "logits"]

    def other(s):
        s["embed_tokens.weight"] = s["embed_tokens.weight"].roll(1, 0).contiguous()

    diagnosis = diagnose(tamper(copy(good, tmp_path / "x"), state=other), target)
    named(diagnosis, WEIGHTS, "embed_tokens.weight", "differs from the target's input embedding")
    assert diagnosis.runs[0].first_divergence == "embed"


def test_a_bare_export_is_held_to_its_own_config_and_the_init_criterion(tiny_model, target, tmp_path):
    """No manifest, so no training checkpoint: the static checks still run, and an untrained head (every matrix a
    fresh draw) is named tensor by tensor."""
    from tests.support.exports import export

    good = export(fit(make_head(tiny_model), tiny_model), tmp_path / "good", "sglang", torch.bfloat16)
    diagnosis = diagnose(good, target)
    assert diagnosis.healthy, diagnosis.report()
    assert [(f.severity, f.file) for f in diagnosis.findings] == [(WARNING, MANIFEST)]  # a bare export
    assert "no other loader here" in diagnosis.report()

    diagnosis = diagnose(export(make_head(tiny_model), tmp_path / "untrained", "sglang", torch.bfloat16), target)
    fresh = {f.key for f in diagnosis.problems if "fresh initialisation" in f.reason}
    assert {"lm_head.weight", "fc.weight", "midlayer.self_attn.q_proj.weight"} <= fresh


# ---------------------------------------------------------------------------------------------------------
# lm_head


def test_a_missing_lm_head_is_named_as_left_at_random_init(exports, target, tmp_path):
    out = tamper(copy(exports["sglang"], tmp_path / "x"), state=lambda s: s.pop("lm_head.weight"))
    diagnosis = diagnose(out, target)
    named(diagnosis, WEIGHTS, "lm_head.weight", "missing", "random initialisation", "#27908")
    assert diagnosis.runs[0].refused and not diagnosis.healthy  # eaglet's own loader refuses it outright


def test_an_lm_head_at_a_fresh_initialisation_is_named(exports, target, tmp_path):
    def fresh(s):
        s["lm_head.weight"] = torch.nn.Linear(64, 100, bias=False).weight.detach().to(torch.bfloat16)

    torch.manual_seed(1234)  # any seed: the test compares distributions
    out = tamper(copy(exports["sglang"], tmp_path / "x"), state=fresh)
    diagnosis = diagnose(out, target)
    named(diagnosis, WEIGHTS, "lm_head.weight", "fresh initialisation", "tau ~1")
    assert [f.key for f in diagnosis.problems if f.file == WEIGHTS] == ["lm_head.weight"]  # one line, not two
    assert diagnosis.runs[0].first_divergence == "logits"


def test_the_fresh_init_criterion_holds_for_any_seed_and_rejects_trained_weights(exports):
    trained = load_file(str(exports["sglang"] / WEIGHTS))["lm_head.weight"]
    for seed in range(3):
        torch.manual_seed(seed)
        draw, fresh = (torch.nn.Linear(64, 100, bias=False).weight.detach() for _ in range(2))
        assert fresh_init_evidence(draw, fresh) is not None
        assert fresh_init_evidence(draw.bfloat16(), fresh) is not None  # an export's rounding
        assert fresh_init_evidence(trained, fresh) is None
        assert fresh_init_evidence(draw * 1.5, fresh) is None  # the same shape of distribution, other scale


# ---------------------------------------------------------------------------------------------------------
# d2t / t2d


@pytest.mark.parametrize("edit,line", [
    pytest.param(lambda s: s.pop("d2t"), ("d2t", "missing", "draft id i for target id i", "#18909"), id="dropped"),
    pytest.param(lambda s: s["d2t"].zero_(), ("d2t", "disagree", "t2d does not mark"), id="zeroed"),
    pytest.param(lambda s: s["d2t"].add_(1), ("d2t", "disagree"), id="offset"),
    pytest.param(lambda s: s["d2t"].add_(384), ("d2t", "outside the target vocabulary"), id="out-of-range"),
])
def test_a_dropped_zeroed_or_offset_d2t_is_named(exports, target, tmp_path, edit, line):
    out = tamper(copy(exports["sglang"], tmp_path / "x"), state=edit)
    diagnosis = diagnose(out, target)
    named(diagnosis, WEIGHTS, *line)


def test_consistent_maps_of_another_vocabulary_are_caught_against_the_training_checkpoint(exports, target,
                                                                                          tmp_path):
    """d2t zeroed and t2d the identity prefix agree with each other (check_export passes them): only the trained
    maps, and the sample's top-1 tokens, show that draft id i is now served as target id i."""
    def identity(s):
        s["d2t"].zero_()
        s["t2d"] = torch.arange(384) < 100

    diagnosis = diagnose(tamper(copy(exports["sglang"], tmp_path / "x"), state=identity), target)
    named(diagnosis, WEIGHTS, "d2t", "differs from the training checkpoint", "other target ids")
    named(diagnosis, WEIGHTS, "t2d", "differs from the training checkpoint")
    assert diagnosis.runs[0].first_divergence == "top-1"  # same logits, other tokens


def test_a_t2d_marking_other_tokens_is_named(exports, target, tmp_path):
    def extra(s):
        s["t2d"][torch.nonzero(~s["t2d"])[0]] = True

    diagnosis = diagnose(tamper(copy(exports["sglang"], tmp_path / "x"), state=extra), target)
    named(diagnosis, WEIGHTS, "t2d", "marks 101 target ids, draft_vocab_size is 100")


# ---------------------------------------------------------------------------------------------------------
# aux layers


def test_vllm_layer_ids_off_by_one_are_named_with_the_numbering(exports, target, tmp_path):
    def renumber(c):
        c["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in c["eagle_aux_hidden_state_layer_ids"]]

    diagnosis = diagnose(tamper(copy(exports["vllm"], tmp_path / "x"), config=renumber), target)
    named(diagnosis, CONFIG, "eagle_aux_hidden_state_layer_ids",
          "vLLM captures the inputs of layers [3, 5, 6], the head was trained on [2, 4, 5]", "off by +1")
    assert diagnosis.runs[0].first_divergence == "fc"  # the fused target states are other layers'


@pytest.mark.parametrize("written,severity,loaders", [
    ([0, 2, 3], PROBLEM, ("SGLang before PR #25454 captures the inputs of layers [1, 3, 4]",
                          "SGLang with PR #25454 captures the inputs of layers [0, 2, 3]")),
    # eaglet's own (input) numbering: right for SGLang with #25454, off by one for the historic rule
    ([2, 4, 5], WARNING, ("SGLang before PR #25454 captures the inputs of layers [3, 5, 6]",)),
])
def test_sglang_layer_ids_are_read_by_both_sglang_rules(exports, target, tmp_path, written, severity, loaders):
    def renumber(c):
        c["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": written}

    diagnosis = diagnose(tamper(copy(exports["sglang"], tmp_path / "x"), config=renumber), target)
    lines = [str(f) for f in diagnosis.findings if f.key == "eagle_config.eagle_aux_hidden_state_layer_ids"
             and f.severity == severity]
    for loader in loaders:
        assert any(loader in line and "trained on [2, 4, 5]" in line for line in lines), diagnosis.report()
    assert diagnosis.healthy == (severity == WARNING)


# ---------------------------------------------------------------------------------------------------------
# rope and positions


def test_fewer_positions_than_the_target_are_named(exports, target, tmp_path):
    def shorter(c):
        c["max_position_embeddings"] = 1024

    diagnosis = diagnose(tamper(copy(exports["sglang"], tmp_path / "x"), config=shorter), target)
    named(diagnosis, CONFIG, "max_position_embeddings", "1024, below the target's 2048", "#48894")


def test_a_rope_theta_other_than_trained_is_named(exports, target, tmp_path):
    def theta(c):
        c["rope_theta"] = 10000.0
        c["rope_parameters"]["rope_theta"] = 10000.0

    diagnosis = diagnose(tamper(copy(exports["sglang"], tmp_path / "x"), config=theta), target)
    named(diagnosis, CONFIG, "rope_theta", "10000.0, the head was trained with 500000.0")
    assert diagnosis.runs[0].first_divergence == "midlayer"


def test_rope_written_two_ways_must_agree_and_carry_no_scaling(exports, target, tmp_path):
    def split(c):
        c["rope_theta"] = 10000.0  # transformers 4 readers; rope_parameters keeps 500000 for transformers 5
        c["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}

    diagnosis = diagnose(tamper(copy(exports["sglang"], tmp_path / "x"), config=split), target)
    named(diagnosis, CONFIG, "rope_theta", "rope_parameters.rope_theta is 500000.0")
    named(diagnosis, CONFIG, "rope_scaling", "without RoPE scaling")


# ---------------------------------------------------------------------------------------------------------
# embeddings


def test_a_stored_embedding_must_be_the_targets(exports, target, tmp_path):
    def other(s):
        s["embed_tokens.weight"] = s["embed_tokens.weight"].flip(0).contiguous()

    diagnosis = diagnose(tamper(copy(exports["vllm"], tmp_path / "x"), state=other), target)
    named(diagnosis, WEIGHTS, "embed_tokens.weight", "differs from the target's input embedding", "#27737")
    assert diagnosis.runs[0].first_divergence == "embed"


def test_a_tied_lm_head_is_named(exports, target, tmp_path):
    def tie(c):
        c["tie_word_embeddings"] = True

    diagnosis = diagnose(tamper(copy(exports["sglang"], tmp_path / "x"), config=tie), target)
    named(diagnosis, CONFIG, "tie_word_embeddings", "must be false", "tie lm_head")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(a tiny Gemma 3 target (embedding scale sqrt(64) = 8, tied embeddings), its vllm export)."""
    from transformers import AutoModelForCausalLM

    from pipeline.target import load_target
    from tests.support.families import FAMILIES, build_family

    path = build_family(FAMILIES["gemma3"], tmp_path_factory.mktemp("gemma3"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    head = fit(make_head(model), model)
    out = stage(tmp_path_factory.mktemp("gemma_stage"), target_cfg(path, "gemma3"), head, formats=("vllm",))["vllm"]
    return load_target(target_cfg(path, "gemma3")), out


def test_gemmas_embedding_scale_baked_into_the_export_is_named(gemma, tmp_path):
    target, good = gemma
    diagnosis = diagnose(good, target)
    assert diagnosis.healthy, diagnosis.report()
    assert any(f.severity == WARNING and f.key == "embed_scale" and "sqrt(hidden_size) = 8" in f.reason
               for f in diagnosis.findings)

    def scaled(s):
        s["embed_tokens.weight"] = (s["embed_tokens.weight"].float() * 8.0).to(torch.bfloat16)

    diagnosis = diagnose(tamper(copy(good, tmp_path / "x"), state=scaled), target)
    named(diagnosis, WEIGHTS, "embed_tokens.weight", "sqrt(hidden_size) = 8", "Gemma's embedding scale baked in")
    assert diagnosis.runs[0].first_divergence == "embed"


# ---------------------------------------------------------------------------------------------------------
# EAGLE-3.1


@pytest.fixture(scope="module")
def eagle31(tmp_path_factory, tiny_model, tiny_model_dir):
    head = fit(make_head(tiny_model, fc_norm=True, norm_output=True), tiny_model)
    with torch.no_grad():
        for norm in head.fc_norm:
            norm.weight.uniform_(0.5, 1.5)
    return stage(tmp_path_factory.mktemp("eagle31"), target_cfg(tiny_model_dir), head)["sglang"]


def test_an_eagle31_export_is_healthy_but_warns_of_loaders_that_ignore_its_norms(eagle31, target):
    diagnosis = diagnose(eagle31, target)
    assert diagnosis.healthy, diagnosis.report()
    (warning,) = [f for f in diagnosis.findings if f.key == "fc_norm, norm_output"]
    assert warning.severity == WARNING and "ignores the keys without an error" in warning.reason


def test_eagle31_keys_dropped_from_the_config_are_named(eagle31, target, tmp_path):
    def drop(c):
        del c["fc_norm"], c["norm_output"]

    diagnosis = diagnose(tamper(copy(eagle31, tmp_path / "x"), config=drop), target)
    named(diagnosis, WEIGHTS, "fc_norm.{0,1,2}.weight", "unexpected", "does not set fc_norm: true")
    named(diagnosis, CONFIG, "fc_norm", "trained with fc_norm=true")
    named(diagnosis, CONFIG, "norm_output", "trained with norm_output=true")


def test_norm_output_alone_dropped_leaves_no_tensor_evidence_but_the_trained_config(eagle31, target, tmp_path):
    def drop(c):
        del c["norm_output"]

    diagnosis = diagnose(tamper(copy(eagle31, tmp_path / "x"), config=drop), target)
    assert problems(diagnosis)[0].startswith("problem: config.json: norm_output: absent or false")
    # one step drafts the same logits either way; the state fed back to the next step differs
    assert diagnosis.runs[0].first_divergence == "midlayer, step 2"


def test_eagle31_keys_nested_where_no_loader_reads_them_are_named(eagle31, target, tmp_path):
    def nest(c):
        c["eagle_config"] = {"fc_norm": c.pop("fc_norm"), "norm_output": c.pop("norm_output")}

    diagnosis = diagnose(tamper(copy(eagle31, tmp_path / "x"), config=nest), target)
    named(diagnosis, CONFIG, "eagle_config.fc_norm", "at the top level of config.json")


# ---------------------------------------------------------------------------------------------------------
# dtype and files


def test_a_torch_dtype_other_than_the_tensors_is_one_line(exports, target, tmp_path):
    def f32(c):
        c["torch_dtype"] = "float32"

    diagnosis = diagnose(tamper(copy(exports["sglang"], tmp_path / "x"), config=f32), target)
    (line,) = [f for f in diagnosis.problems if f.key == "torch_dtype"]
    assert "tensors are BF16 but config.json's torch_dtype says float32" in line.reason


def test_vllm_dtypes_must_agree_between_the_two_configs(exports, target, tmp_path):
    def split(c):
        c["torch_dtype"] = "float32"  # the layer config keeps bfloat16, as the tensors

    diagnosis = diagnose(tamper(copy(exports["vllm"], tmp_path / "x"), config=split), target)
    named(diagnosis, CONFIG, "torch_dtype", "float32 at the top level, bfloat16 in transformer_layer_config")


def test_a_file_changed_after_the_export_is_named(exports, target, tmp_path):
    out = copy(exports["sglang"], tmp_path / "x")
    doc = json.loads((out / CONFIG).read_text())
    (out / CONFIG).write_text(json.dumps(doc) + "\n")  # same content, other bytes: digests differ
    diagnosis = diagnose(out, target)
    named(diagnosis, CONFIG, "sha256", "changed since the export stage wrote it")


# ---------------------------------------------------------------------------------------------------------
# the command line


def test_the_cli_exits_non_zero_with_the_problem_lines(exports, tmp_path):
    out = tamper(copy(exports["sglang"], tmp_path / "x"), state=lambda s: s.pop("lm_head.weight"))
    run = subprocess.run([sys.executable, "-m", "pipeline.doctor", str(out)], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 1, run.stderr[-3000:]
    assert "problem: model.safetensors: lm_head.weight: missing" in run.stdout
    assert "NOT healthy" in run.stdout
    assert doctor_main([str(tmp_path / "nowhere")]) == 2
    # static checks only: the target's parts are read, the target is not run
    assert doctor_main([str(out), "--no-sample"]) == 1
    assert doctor_main([str(exports["vllm"]), "--no-sample"]) == 0


# ---------------------------------------------------------------------------------------------------------
# GGUF (llama.cpp), on the real target


@pytest.mark.slow
def test_a_gguf_export_is_read_back_with_gguf_py_and_held_to_the_training_forward(smollm2, tmp_path):
    """The export stage's gguf format on SmolLM2 (llama.cpp's own converter, as tests/test_export_gguf.py): the
    doctor reads draft.gguf back with gguf-py into a head and runs the sample through it beside load_export; an
    EAGLE-3.1 config in that folder is named, llama.cpp having no such norms."""
    from pipeline.export.formats import ExportError
    from pipeline.export.formats.gguf import llama_cpp_source
    from tests.support.gguf import smollm2_head

    try:
        llama_cpp_source()
    except ExportError as e:
        pytest.fail(str(e))  # make test unpacks the converter with llama-server: never a silent skip
    head = fit(smollm2_head(smollm2), smollm2.model, steps=10)
    good = stage(tmp_path / "stage", TargetConfig(dtype="float32", device="cpu"), head, formats=("gguf",))["gguf"]
    diagnosis = diagnose(good, smollm2)
    assert diagnosis.healthy, diagnosis.report()
    runs = {r.name: r for r in diagnosis.runs}
    assert set(runs) == {"load_export", "draft.gguf (gguf-py)"}
    assert all(r.first_divergence is None and r.refused is None for r in runs.values()), diagnosis.report()
    assert "format sglang + draft.gguf" in diagnosis.report()

    def eagle31(c):
        c["fc_norm"] = c["norm_output"] = True

    def norms(s):
        s.update({f"fc_norm.{i}.weight": torch.ones(576, dtype=torch.bfloat16) for i in range(3)})

    diagnosis = diagnose(tamper(copy(good, tmp_path / "x"), config=eagle31, state=norms), smollm2)
    named(diagnosis, "draft.gguf", "fc_norm, norm_output", "llama.cpp's EAGLE-3 draft has no EAGLE-3.1 norms")
