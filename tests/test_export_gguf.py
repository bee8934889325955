"""export.format=gguf (pipeline/export/formats/gguf.py): an EAGLE-3 head at SmolLM2-135M's dimensions converted by
llama.cpp's own converter (the one `make llama-server` unpacks), read back and held to the head tensor by tensor,
then served by the real llama-server beside the target's GGUF: it drafts, and greedy output equals the server's
output without the draft."""
from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.export.exporter import export_head, load_export, max_logit_diff, read_config
from pipeline.export.formats import ExportError
from pipeline.export.formats.gguf import GGUF_FILE, gguf_problems, llama_cpp_source
from pipeline.regen.managed_server import free_port
from pipeline.target import TargetConfig, load_target_parts, resolve_source
from tests.support.gguf import smollm2_head, to_gguf

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

CUSTOM_LAYERS = [1, 10, 20]  # not the default [2, 15, 27]: the layer ids must reach llama.cpp


@pytest.fixture(scope="module")
def converter():
    try:
        return llama_cpp_source()
    except ExportError as e:
        pytest.fail(str(e))  # make test unpacks it with llama-server: never a silent skip


def test_a_head_with_custom_layers_converts_and_reads_back_exactly(smollm2, converter, tmp_path):
    head = smollm2_head(smollm2, CUSTOM_LAYERS)
    out = to_gguf(head, tmp_path / "gguf", smollm2)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", GGUF_FILE, "model.safetensors"]
    state = load_file(str(out / "model.safetensors"))
    assert gguf_problems(out / GGUF_FILE, head.config, state) == []  # every tensor and field, d2t as target ids
    # The safetensors half is the sglang export: eaglet loads it back (the GGUF is made from it).
    assert max_logit_diff(head, load_export(out, smollm2.model, dtype=torch.float32)) < 0.05  # bf16 rounding

    # What the checks catch: another head's lm_head, other layers, a d2t read as offsets.
    other = dict(state, **{"lm_head.weight": state["lm_head.weight"].flip(0)})
    assert any("output.weight: values differ" in p for p in gguf_problems(out / GGUF_FILE, head.config, other))
    moved = smollm2_head(smollm2, [2, 15, 27]).config
    assert "eagle3.target_layers = [1, 10, 20], expected [2, 15, 27]" in gguf_problems(out / GGUF_FILE, moved, state)


def test_the_sglang_config_alone_would_give_llama_cpp_the_default_layers(smollm2, converter, tmp_path):
    """Why the gguf format writes the layer ids for the converter: handed the sglang export as it is (custom layers
    under SGLang's `eagle_config`), llama.cpp's converter ignores them and writes the default layers."""
    head = smollm2_head(smollm2, CUSTOM_LAYERS)
    sglang = export_head(head, tmp_path / "sglang", "sglang", torch.bfloat16, num_target_layers=30,
                         verifier="x", verifier_architectures=["LlamaForCausalLM"])
    assert read_config(sglang)["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    gguf = tmp_path / "plain.gguf"
    subprocess.run([__import__("sys").executable, str(converter / "convert_hf_to_gguf.py"), str(sglang),
                    "--target-model-dir", str(smollm2.source), "--outfile", str(gguf), "--outtype", "bf16"],
                   check=True, capture_output=True, timeout=600)
    problems = gguf_problems(gguf, head.config, load_file(str(sglang / "model.safetensors")))
    assert problems == ["eagle3.target_layers = [2, 15, 27], expected [1, 10, 20]"]


def _complete(binary: Path, target_gguf: str, prompt: str, draft: Path | None = None) -> dict:
    """One greedy completion from a llama-server started for it (with the draft, when given), then stopped."""
    port = free_port()
    cmd = [str(binary), "-m", target_gguf, "--port", str(port), "--host", "127.0.0.1", "-t", "1", "-c", "1024",
           "-np", "1"]
    if draft is not None:
        cmd += ["-md", str(draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max", "4"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"llama-server did not come up: {server.stderr.read()[-2000:]}")
            time.sleep(0.5)
        body = json.dumps({"prompt": prompt, "n_predict": 24, "temperature": 0, "cache_prompt": False}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            return json.loads(r.read())
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def stage_export(smollm2, converter, tmp_path_factory):
    """The export stage with export.format=gguf on the default target (a fake train stage's head); what it
    printed."""
    import contextlib
    import io

    from pipeline.config import EagletConfig
    from pipeline.export.config import ExportConfig
    from pipeline.export.run import main
    from pipeline.heads import head_config
    from tests.support.exports import fake_train_stage

    cfg = EagletConfig(stage="export", name="t", output_root=str(tmp_path_factory.mktemp("stage")),
                       head=head_config("eagle3"), export=ExportConfig(format="gguf"))
    fake_train_stage(cfg, smollm2_head(smollm2))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out = main(cfg)
    return out, printed.getvalue()


def test_the_stage_writes_the_gguf_records_it_and_prints_the_llama_server_command(stage_export):
    out, printed = stage_export
    kind, target_gguf = resolve_source(TargetConfig())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "gguf" and set(manifest["files"]) == {"config.json", "model.safetensors", GGUF_FILE}
    assert (f"llama-server -m {target_gguf} -md {out.resolve() / GGUF_FILE} --spec-type draft-eagle3 "
            f"--spec-draft-n-max 6") in printed
    load_export(out, load_target_parts(TargetConfig()))  # the manifest's digests, draft.gguf's among them, hold


def test_llama_server_drafts_with_the_export_and_keeps_its_greedy_output(stage_export, server_binary):
    """The real engine: llama-server loads the GGUF as an EAGLE-3 draft for the target's own GGUF and drafts with
    it; its greedy output equals the output without a draft (llama.cpp verifies every drafted token)."""
    kind, target_gguf = resolve_source(TargetConfig())
    assert kind == "gguf"
    out, _ = stage_export
    prompt = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"
    plain = _complete(server_binary, str(target_gguf), prompt)
    drafted = _complete(server_binary, str(target_gguf), prompt, out / GGUF_FILE)
    assert drafted["timings"]["draft_n"] > 0  # the draft was loaded and used
    assert drafted["content"] == plain["content"]


def test_an_eagle31_head_is_refused_before_any_conversion(tiny_model, tmp_path):
    """llama.cpp's EAGLE-3 draft has no per-state norms: such a head would load and draft as a plain EAGLE-3."""
    from tests.support.exports import make_head

    head = make_head(tiny_model, fc_norm=True, norm_output=True)
    with pytest.raises(ExportError, match="no EAGLE-3.1 norms"):
        export_head(head, tmp_path / "gguf", "gguf", torch.float32, num_target_layers=8, verifier="x",
                    verifier_architectures=["LlamaForCausalLM"], target_dir=str(tmp_path))
    assert not (tmp_path / "gguf").exists()
