"""The target's parts without the target (issue: targets larger than one GPU): the weights digest read from the
stored safetensors files equals the loaded model's on every family, the parts equal the loaded model's tensors,
ranks wait for one first dequantization, and offline training and export of a target padded with large layers
stay far below its weights' size in peak RSS (the processes' own counters, from wait4)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.lock import first_writer_lock
from pipeline.manifest import check_fingerprint, load_manifest
from pipeline.target import (
    TargetConfig,
    files_weights_digest,
    load_target,
    load_target_parts,
    weights_digest,
)
from tests.support.families import FAMILIES, build_family, build_padded_moe
from tests.support.paths import REPO
from tests.support.tiny_runs import as_cli, build_tiny_dump, overrides


def local_target(path: Path, dtype: str = "float32") -> TargetConfig:
    return TargetConfig(name="t", path=str(path), gguf_package=None, gguf_file=None, hub_id=None, dtype=dtype)


def stored_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype="auto")


def assert_same_parts(full, parts) -> None:
    assert parts.fingerprint == full.fingerprint
    for get in (lambda m: m.get_input_embeddings().weight, lambda m: m.get_output_embeddings().weight,
                lambda m: m.base_model.norm.weight):
        assert torch.equal(get(parts.model), get(full.model))
    assert parts.model.config.to_dict() == full.model.config.to_dict()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_files_digest_and_parts_equal_the_loaded_model_on_every_family(family, tmp_path):
    path = build_family(FAMILIES[family], tmp_path / family)
    model = stored_model(path)
    digest, renamed = files_weights_digest(str(path), model.config)
    # Qwen3-MoE's experts are stored one tensor each and fused at load: the files digest hashes the stored names.
    assert renamed == (family == "qwen3_moe")
    if not renamed:
        assert digest == weights_digest(model)
    full, parts = load_target(local_target(path)), load_target_parts(local_target(path))
    assert_same_parts(full, parts)
    assert (full.fingerprint.get("weights_digest_names") == "stored") == renamed


def test_tied_bf16_and_sharded_checkpoints(tiny_tokenizer, tmp_path):
    from tests.support.tiny import build_tiny_llama

    model = build_tiny_llama(len(tiny_tokenizer), seed=3)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path / "m", max_shard_size="100KB")  # several files behind an index
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    stored = stored_model(tmp_path / "m")
    assert stored.config.tie_word_embeddings and next(stored.parameters()).dtype == torch.bfloat16
    assert files_weights_digest(str(tmp_path / "m"), stored.config) == (weights_digest(stored), False)
    # Computing in fp32 changes neither the identity nor the parts' values (upcast from bf16 is exact).
    full, parts = load_target(local_target(tmp_path / "m")), load_target_parts(local_target(tmp_path / "m"))
    assert_same_parts(full, parts)
    assert parts.model.get_output_embeddings().weight is parts.model.get_input_embeddings().weight
    assert parts.model.get_input_embeddings().weight.dtype == torch.float32


def test_a_changed_tensor_changes_the_files_digest(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    other.mkdir()
    for f in tiny_model_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    state = load_file(str(other / "model.safetensors"))
    state["model.layers.3.mlp.down_proj.weight"][0, 0] += 1.0  # element 0: always in the strided sample
    save_file(state, str(other / "model.safetensors"), metadata={"format": "pt"})
    a, b = load_target_parts(local_target(tiny_model_dir)), load_target_parts(local_target(other))
    assert a.fingerprint["weights_digest"] != b.fingerprint["weights_digest"]


def test_outputs_of_a_renamed_checkpoint_made_before_the_files_digest_still_load(tmp_path, caplog):
    path = build_family(FAMILIES["qwen3_moe"], tmp_path / "moe")
    current = load_target_parts(local_target(path)).fingerprint
    old = {k: v for k, v in current.items() if k != "weights_digest_names"}
    old["weights_digest"] = "0123456789abcdef"  # the digest of the fused tensors, which the files do not hold
    check_fingerprint(current, old, tmp_path / "manifest.json")
    assert "not compared" in caplog.text
    with pytest.raises(Exception, match="weights digest"):  # a manifest of the current kind is still compared
        check_fingerprint(current, {**old, "weights_digest_names": "stored"}, tmp_path / "manifest.json")


LOCK_CHILD = """
import sys, time
from pathlib import Path
from pipeline.lock import first_writer_lock
out, log = Path(sys.argv[1]), Path(sys.argv[2])
with first_writer_lock(out):
    with open(log, "a") as f:
        f.write(f"start {sys.argv[3]}\\n"); f.flush(); time.sleep(0.5); f.write(f"end {sys.argv[3]}\\n")
"""


def test_ranks_wait_for_the_first_dequantization(tmp_path):
    """Four processes enter the first-load lock at once: their critical sections never overlap."""
    log = tmp_path / "log"
    procs = [subprocess.Popen([sys.executable, "-c", LOCK_CHILD, str(tmp_path / "targets" / "x"), str(log), str(i)],
                              cwd=REPO) for i in range(4)]
    assert all(p.wait(timeout=60) == 0 for p in procs)
    lines = log.read_text().split()
    events = list(zip(lines[0::2], lines[1::2]))
    assert len(events) == 8
    for k in range(0, 8, 2):  # start i is always followed by end i
        assert events[k][0] == "start" and events[k + 1] == ("end", events[k][1])
    with first_writer_lock(tmp_path / "targets" / "x"):  # released by the children: taken at once
        pass


# ---------------------------------------------------------------------------------------------------------
# peak memory: a tiny target padded with large MLP layers


@pytest.fixture(scope="module")
def padded(tmp_path_factory, shared_data):
    """(outputs root with a dump of the padded target, its directory, its fp32 weights' bytes)."""
    root = tmp_path_factory.mktemp("padded")
    path, fp32_bytes = build_padded_moe(root / "target")
    build_tiny_dump(root, path, shared_data, rows=6)
    return root, path, fp32_bytes


def run(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "pipeline.run", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "WANDB_MODE": "disabled"})
    assert done.returncode == 0, done.stderr[-3000:]


def test_offline_training_and_export_never_materialize_the_target(padded):
    """Peak RSS as each stage process counted it (its manifest's timings.peak_rss_mb, Linux VmHWM)."""
    root, path, fp32_bytes = padded
    d = overrides(root, path, "eagle3", "h", epochs=1, tau_prompts=0, save_every=100, eval_every=100)
    run(as_cli(d))
    run(["stage=export", "target=hf", f"target.path={path}", "target.name=tiny", f"target.hub_id={path}", "name=t",
         f"output_root={root}", "export.format=sglang", "head.name=h"])
    train = load_manifest(root / "t" / "train" / "h")["timings"]["peak_rss_mb"]
    export = load_manifest(root / "t" / "export" / "h" / "sglang")["timings"]["peak_rss_mb"]
    print(f"fp32 weights {fp32_bytes / 2**20:.0f} MiB; peak RSS train {train:.0f} MiB, export {export:.0f} MiB")
    # The trainer reads the parts in fp32: loading the target would alone take fp32_bytes.
    assert max(train, export) * 2**20 < 0.5 * fp32_bytes
