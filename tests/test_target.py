"""Target loading: the GGUF is dequantized once into a cache; later loads are fast and identical."""
import dataclasses
import json
import time

import pytest
import torch

from pipeline import precision
from pipeline.target import TargetConfig, load_target, weights_digest


def test_local_hf_directory_and_fingerprint(tiny_model_dir, tmp_path):
    t = load_target(TargetConfig(name="tiny", path=str(tiny_model_dir), gguf_package=None, cache_dir=str(tmp_path)))
    assert t.device.type == "cpu" and t.dtype == torch.float32
    fp = t.fingerprint
    assert fp["config"]["num_hidden_layers"] == 8 and len(fp["weights_digest"]) == 16
    again = load_target(TargetConfig(name="tiny", path=str(tiny_model_dir), gguf_package=None))
    assert again.fingerprint["weights_digest"] == fp["weights_digest"]
    with torch.no_grad():
        t.model.model.layers[0].mlp.up_proj.weight[0, 0] += 1.0
    assert weights_digest(t.model) != fp["weights_digest"]


def test_identity_does_not_depend_on_the_compute_precision(tiny_model_dir):
    """weights_digest is taken from the weights as stored: a bf16 load of an fp32 checkpoint keeps the fp32
    load's fingerprint (so a bf16 eval accepts heads trained on fp32 dumps), and says its precision."""
    cfg = TargetConfig(name="tiny", path=str(tiny_model_dir), gguf_package=None, dtype="float32")
    fp32 = load_target(cfg)
    bf16 = load_target(dataclasses.replace(cfg, dtype="bfloat16"))
    assert (fp32.precision, bf16.precision) == ("float32", "bfloat16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    assert bf16.fingerprint == fp32.fingerprint
    # The digest of the cast weights differs: hashing the loaded model would have broken the identity.
    assert weights_digest(bf16.model) != fp32.fingerprint["weights_digest"]


def test_auto_precision_is_the_capability_and_explicit_names_win(monkeypatch, fresh_precision, tmp_path):
    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path))  # the measured decision is cached there
    cpu = torch.device("cpu")
    for flag, want in (("1", torch.bfloat16), ("0", torch.float32)):
        monkeypatch.setenv(precision.ENV_OVERRIDE, flag)
        precision.fast_bf16.cache_clear()
        assert precision.resolve_dtype("auto", cpu) == want
        assert precision.resolve_dtype("float32", cpu) == torch.float32
        assert precision.resolve_dtype("bf16", cpu) == torch.bfloat16
    monkeypatch.setenv(precision.ENV_OVERRIDE, "yes")
    precision.fast_bf16.cache_clear()
    with pytest.raises(ValueError, match="EAGLET_FAST_BF16"):
        precision.resolve_dtype("auto", cpu)
    monkeypatch.delenv(precision.ENV_OVERRIDE)
    precision.fast_bf16.cache_clear()
    # Without the override: torch's capability query, confirmed by a measurement (a ratio, always positive),
    # decided once per machine and torch version: the cached decision is what later processes read.
    decided = precision.fast_bf16("cpu")
    assert isinstance(decided, bool) and precision.measure_cpu_bf16_speedup() > 0
    cached = list(tmp_path.glob("precision-*.json"))
    if precision._cpu_bf16_advertised():
        assert len(cached) == 1 and json.loads(cached[0].read_text())["fast_bf16"] == decided


def test_missing_paths_are_clear():
    with pytest.raises(FileNotFoundError, match="not found"):
        load_target(TargetConfig(path="/nonexistent/model.gguf"))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_target(TargetConfig(path="./nope"))
    with pytest.raises(FileNotFoundError, match="is not installed"):
        load_target(TargetConfig(path="", gguf_package="no_such_pkg_eaglet"))
    with pytest.raises(ValueError, match="target.dtype"):
        precision.resolve_dtype("float8", torch.device("cpu"), "target.dtype")
    with pytest.raises(ValueError, match="export.dtype='fp16': choose one of bfloat16, float32"):
        precision.resolve_dtype("fp16", torch.device("cpu"), "export.dtype", choices=("bfloat16", "float32"))


@pytest.mark.slow
@pytest.mark.smollm2
def test_gguf_cache_is_fast_and_exact(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    # The reference: the model transformers itself dequantized from the GGUF (the first load's own, kept here
    # rather than dequantized a second time), against which the cache written from it is held.
    dequantized = []

    def from_pretrained(*args, **kwargs):
        model = from_pretrained.real(*args, **kwargs)
        dequantized.append((args, kwargs, model))
        return model

    from_pretrained.real = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    cfg = TargetConfig(cache_dir=str(tmp_path))
    t0 = time.perf_counter()
    first = load_target(cfg)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cached = load_target(cfg)
    cached_s = time.perf_counter() - t0
    print(f"\nfirst (dequantizing) load {first_s:.2f} s, cached load {cached_s:.2f} s, "
          f"ratio {first_s / cached_s:.1f}x")
    assert first_s >= 5 * cached_s
    cfgd = first.model.config
    assert (cfgd.num_hidden_layers, cfgd.hidden_size, cfgd.vocab_size) == (30, 576, 49152)
    from pipeline.target import packaged_gguf
    gguf = packaged_gguf(cfg.gguf_package, cfg.gguf_file)
    ((args, kwargs, ref),) = [d for d in dequantized if d[1].get("gguf_file")]  # one dequantization, the first load's
    assert args == (gguf.parent,) and kwargs == {"gguf_file": gguf.name, "dtype": torch.float32}
    ref.eval()
    ids = cached.tokenizer("Speculative decoding is lossless.", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(cached.model(ids).logits, ref(ids).logits, rtol=0, atol=0)
    assert cached.fingerprint == first.fingerprint
    # Dense weights, plain modules: no GGUF quantizer attached to the cached model (nor its packed-weight warning).
    assert getattr(cached.model, "hf_quantizer", None) is None
    assert not hasattr(cached.model.config, "quantization_config")
    assert cached.tokenizer.chat_template and "<|im_start|>" in cached.tokenizer.chat_template
