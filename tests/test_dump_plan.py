"""`stage=dump dump.plan_only=true`: the sizing before anything runs agrees with the dump that then runs (tokens,
rows, shard count, bytes on disk), writes nothing but plan.json, and scales the per-rank weights with the
tensor-parallel layout; on a Llama-3.1-70B-shaped config its arithmetic gives the walkthrough's numbers."""
from __future__ import annotations

import dataclasses
import json

import pytest

from pipeline.config import EagletConfig
from pipeline.hidden_states.config import DumpConfig
from pipeline.hidden_states.sizing import disk, memory_per_rank, target_parameters
from pipeline.manifest import load_manifest
from tests.support.tiny_runs import EXPERIMENT, tiny_data, tiny_target


def dump_config(root, model_dir, shared_data, **dump) -> EagletConfig:
    return EagletConfig(stage="dump", name=EXPERIMENT, output_root=str(root), target=tiny_target(model_dir),
                        data=tiny_data(shared_data, 24), dump=DumpConfig(input="data", shard_bytes=64 * 1024, **dump))


def test_plan_only_predicts_the_dump_that_runs(tmp_path, tiny_model_dir, shared_data, capsys):
    from pipeline.hidden_states.run import main

    cfg = dump_config(tmp_path, tiny_model_dir, shared_data, plan_only=True)
    plan = main(cfg)
    dump_dir = cfg.stage_dir("dump")
    assert sorted(p.name for p in dump_dir.iterdir()) == ["plan.json"]  # nothing else written
    assert json.loads((dump_dir / "plan.json").read_text())["tokens"] == plan["tokens"]
    assert "estimated memory per rank" in capsys.readouterr().out

    main(dataclasses.replace(cfg, dump=dataclasses.replace(cfg.dump, plan_only=False)))
    manifest = load_manifest(dump_dir, expect_stage="dump")
    assert (plan["rows"], plan["tokens"]) == (manifest["counts"]["rows"], manifest["counts"]["tokens"])
    assert plan["planned_shards"] == manifest["counts"]["shards"]
    # The dump's own dtype here is fp32 (the suite's precision): the Arrow layout adds a small overhead.
    predicted, written = plan["disk"]["float32"]["bytes"], manifest["totals"]["bytes"]
    assert predicted <= written <= 1.05 * predicted


def test_per_rank_weights_scale_with_tensor_parallel(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    one, two = (memory_per_rank(config, tp, "bfloat16", 4096, 3, 1000, 4096) for tp in (1, 2))
    assert two["target_weights_gib"] == pytest.approx(one["target_weights_gib"] / 2, rel=0.02)
    assert two["offline_training_gib"] == one["offline_training_gib"]  # offline never holds the target


def test_llama_70b_sizes():
    """Llama-3.1-70B-Instruct's architecture (config values only): 70.6B parameters; an EAGLE-3 dump of 500M
    tokens (500k conversations of about 1,000 tokens) is 32.8 TB in bf16, 122k shards at 256 MiB."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
    assert target_parameters(config) == pytest.approx(70.55e9, rel=0.001)
    bf16 = disk(500_000_000, 8192, 3, 256 * 2**20)["bfloat16"]
    assert bf16["bytes_per_token"] == 4 * 8192 * 2 + 5
    assert bf16["bytes"] == pytest.approx(32.77e12, rel=0.001) and bf16["shards"] == 122_080
    m = memory_per_rank(config, 8, "bfloat16", 8192, 3, 1_000_000_000, 8192)
    assert m["target_weights_gib"] == pytest.approx(70.55e9 * 2 / 8 / 2**30, rel=0.001)  # 16.4 GiB of an 80 GB H100
