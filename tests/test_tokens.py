"""The tokenized input made once per experiment (hidden_states/tokens.py): the arrays equal a direct tokenization,
later runs and other ranks read them instead of tokenizing, another setting makes other arrays, and ranks that
start together tokenize once."""
from __future__ import annotations

import subprocess
import sys

import numpy as np

from pipeline.data.bad_records import BadRecordReport
from pipeline.data.readers import read_sources
from pipeline.hidden_states.inputs import tokenize_all
from pipeline.hidden_states.tokens import TOKENS_DIR, tokenized_input
from pipeline.target import load_target_parts
from tests.support.paths import REPO
from tests.support.tiny_runs import EXPERIMENT
from tests.support.tokens import config


def test_tokens_are_made_once_and_equal_a_direct_tokenization(tmp_path, tiny_model_dir, shared_data):
    cfg = config(tmp_path, tiny_model_dir, shared_data)
    target = load_target_parts(cfg.target)
    first = tokenized_input(cfg, target)
    direct, counts = tokenize_all(read_sources(cfg.data, BadRecordReport()), target.tokenizer, cfg.data)
    assert not first.cached and len(first.samples) == len(direct) > 0 and first.counts == dict(counts)
    for got, want in zip(first.samples, direct):
        assert got.id == want.id
        assert np.array_equal(got.input_ids, want.input_ids) and np.array_equal(got.loss_mask, want.loss_mask)
    again = tokenized_input(cfg, target)
    assert again.cached and again.samples.directory == first.samples.directory
    shorter = tokenized_input(config(tmp_path, tiny_model_dir, shared_data, max_length=48), target)
    assert not shorter.cached and shorter.samples.directory != first.samples.directory
    assert max(len(s) for s in shorter.samples) <= 48


def test_an_edited_source_makes_new_tokens(tmp_path, tiny_model_dir, shared_data):
    source = tmp_path / "conversations.json"
    source.write_bytes((shared_data / "alpaca_en_demo" / "alpaca_en_demo.json").read_bytes())
    cfg = config(tmp_path, tiny_model_dir, shared_data)
    cfg.data.sources[0].path = str(source)
    target = load_target_parts(cfg.target)
    first = tokenized_input(cfg, target)
    source.write_text(source.read_text().replace("a", "b", 1))  # the first record changes
    edited = tokenized_input(cfg, target)
    assert not edited.cached and edited.samples.directory != first.samples.directory


RANK = """
import sys
from pathlib import Path
from tests.support.tokens import config
from pipeline.hidden_states.tokens import tokenized_input
from pipeline.target import load_target_parts
cfg = config(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
print("CACHED", tokenized_input(cfg, load_target_parts(cfg.target)).cached)
"""


def test_ranks_starting_together_tokenize_once(tmp_path, tiny_model_dir, shared_data):
    # RANK imports tests.support.tokens, from the repository root (cwd)
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path), str(tiny_model_dir), str(shared_data)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(o.split("CACHED")[-1].strip() for o in outs) == ["False", "True", "True"]
    assert len(list((tmp_path / EXPERIMENT / TOKENS_DIR).iterdir())) == 2  # the arrays and their lock file
