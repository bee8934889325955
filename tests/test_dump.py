"""Stage dump: capture correctness, padding invariance, the Arrow format and its zero-copy reader, manifest
checks, verification, resumption and ranks -- on the tiny Llama (SmolLM2 checks are marked slow)."""
from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import pytest
import torch

from pipeline.config import EagletConfig
from pipeline.data.chat import tokenize_conversation
from pipeline.data.config import DataConfig
from pipeline.dist import RankInfo
from pipeline.heads import default_aux_layer_ids
from pipeline.hidden_states.capture import HiddenStateCapture, pad_batch, resolve_layer_ids
from pipeline.hidden_states.config import DumpConfig
from pipeline.hidden_states.dump import dump_hidden_states, forward_batch, plan_dump
from pipeline.hidden_states.plan import TokenizedSample, plan_batches, plan_shards
from pipeline.hidden_states.reader import DumpReader, verify_dump
from pipeline.manifest import ManifestError, load_manifest, write_manifest
from pipeline.target import TargetConfig, load_target
from tests.support.dump_samples import make_conversation, make_samples


@pytest.fixture(scope="module")
def tiny_target(tiny_model_dir):
    return load_target(TargetConfig(name="tiny", path=str(tiny_model_dir), gguf_package=None))


@pytest.fixture(scope="module")
def samples(tiny_tokenizer):
    return make_samples(tiny_tokenizer, 24)


SMALL = dict(batch_tokens=256, max_batch_size=4, shard_bytes=120_000)


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.arrow"))}


# -- layers and plan --------------------------------------------------------------------------------------


def test_layer_ids_default_and_validation():
    assert default_aux_layer_ids(30) == [2, 15, 27] and default_aux_layer_ids(8) == [2, 4, 5]
    assert resolve_layer_ids(None, 8) == [2, 4, 5] and resolve_layer_ids([0, 7], 8) == [0, 7]
    with pytest.raises(ValueError, match="out of range"):
        resolve_layer_ids([2, 8], 8)
    with pytest.raises(ValueError, match="duplicates"):
        resolve_layer_ids([2, 2], 8)


def test_plan_groups_by_length_within_budget():
    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(200)] + [1000]
    batches = plan_batches(lengths, batch_tokens=1024, max_batch_size=8)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        widths = [lengths[i] for i in b]
        assert widths == sorted(widths, reverse=True) and len(b) <= 8
        assert len(b) * widths[0] <= 1024 or len(b) == 1
    assert batches[0] == [200]  # longer than the budget: alone, and first (longest first)
    assert plan_batches(lengths, 1024, 8) == batches
    shards = plan_shards([10, 10, 10, 25, 5], shard_bytes=20)
    assert shards == [[0, 1], [2], [3], [4]]


# -- capture ----------------------------------------------------------------------------------------------


def test_capture_matches_hf_hidden_states_and_lm_head(tiny_target, samples):
    model, layer_ids = tiny_target.model, [0, 2, 4, 7]
    ids = torch.tensor([samples[0].input_ids])
    with HiddenStateCapture(model, layer_ids) as cap:
        aux, final = cap.forward(ids)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    H = tiny_target.hidden_size
    for k, i in enumerate(layer_ids):
        torch.testing.assert_close(aux[..., k * H:(k + 1) * H], ref.hidden_states[i], rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head(final), ref.logits, rtol=1e-5, atol=1e-5)


def test_padding_does_not_change_states(tiny_target, samples):
    rows = sorted(samples[:6], key=len, reverse=True)
    assert len(rows[0]) > len(rows[-1]) + 10  # real padding
    with HiddenStateCapture(tiny_target.model, [1, 3, 6]) as cap:
        ids, mask = pad_batch([r.input_ids for r in rows], tiny_target.device)
        aux_b, final_b = cap.forward(ids, mask)
        for b, r in enumerate(rows):
            aux_1, final_1 = cap.forward(torch.tensor([r.input_ids]))
            n = len(r)
            torch.testing.assert_close(aux_b[b, :n], aux_1[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(final_b[b, :n], final_1[0], rtol=1e-5, atol=1e-5)


# -- dump + reader ----------------------------------------------------------------------------------------


def test_reader_tokens_are_the_rows_tokens_batch_by_batch(tiny_target, samples, tmp_path):
    """`tokens` (what the draft vocabulary counts) gives the chosen rows' tokens in storage order, no more, none
    twice: whole record batches and parts of them, whatever the order of the indices."""
    dump_hidden_states(tiny_target, samples, DumpConfig(**SMALL), tmp_path, progress=False)
    reader = DumpReader(tmp_path)
    rng = random.Random(0)
    for chosen in (list(range(len(reader))), rng.sample(range(len(reader)), len(reader) // 2), [len(reader) - 1], []):
        pieces = list(reader.tokens(chosen))
        assert len(pieces) <= len(chosen)
        got_ids = torch.cat([p[0].long() for p in pieces]) if pieces else torch.zeros(0, dtype=torch.long)
        got_mask = torch.cat([p[1].long() for p in pieces]) if pieces else torch.zeros(0, dtype=torch.long)
        want = [reader[i] for i in sorted(chosen)]  # rows are numbered in storage order
        assert got_ids.tolist() == [t for r in want for t in r.input_ids.tolist()]
        assert got_mask.tolist() == [m for r in want for m in r.loss_mask.tolist()]
    assert sum(len(p[0]) for p in reader.tokens(range(len(reader)))) == reader.num_tokens
    with pytest.raises(ValueError, match="twice"):
        list(reader.tokens([0, 0]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dump_roundtrip_zero_copy(tiny_target, samples, tmp_path, dtype):
    cfg = DumpConfig(dtype=dtype, **SMALL)
    summary = dump_hidden_states(tiny_target, samples, cfg, tmp_path, progress=False)
    manifest = load_manifest(tmp_path, expect_stage="dump")
    assert summary.shards == len(manifest["shards"]) >= 3
    assert manifest["layers"] == {"ids": [2, 4, 5], "convention": "input-to-layer", "final": "final-norm-output",
                                  "num_target_layers": 8}
    assert manifest["dtype"] == dtype and manifest["hidden_size"] == 64
    assert manifest["totals"]["tokens"] == sum(len(s) for s in samples)
    assert manifest["totals"]["bytes"] == sum(p.stat().st_size for p in tmp_path.glob("shard-*.arrow"))

    reader = DumpReader(tmp_path, expect_target=tiny_target.fingerprint, expect_layer_ids=[2, 4, 5])
    assert len(reader) == len(samples) and reader.num_tokens == manifest["totals"]["tokens"]
    by_id = {s.id: s for s in samples}
    assert sorted(r.id for r in reader) == sorted(by_id)

    # Every row equals its batch's capture, stored bit-exact (bf16 included).
    layout, plan = plan_dump(tiny_target, samples, cfg)
    row = 0
    with HiddenStateCapture(tiny_target.model, layout.layer_ids) as cap:
        for batch in plan.batches:
            aux, final = forward_batch(cap, [samples[i] for i in batch], tiny_target.device, layout.dtype)
            start = 0
            for i in batch:
                got, n = reader[row], len(samples[i])
                assert got.id == samples[i].id and reader.lengths[row] == n
                assert got.input_ids.dtype == got.loss_mask.dtype == torch.int64
                assert got.input_ids.tolist() == samples[i].input_ids and got.loss_mask.tolist() == samples[i].loss_mask
                assert got.aux_hidden.shape == (n, 3 * 64) and got.final_hidden.shape == (n, 64)
                assert got.aux_hidden.dtype == layout.dtype
                assert torch.equal(got.aux_hidden, aux[start:start + n])
                assert torch.equal(got.final_hidden, final[start:start + n])
                start, row = start + n, row + 1

    # DataLoader workers get a pickled reader that maps the shards again on first access.
    clone = pickle.loads(pickle.dumps(reader))
    assert torch.equal(clone[len(clone) - 1].aux_hidden, reader[len(reader) - 1].aux_hidden)

    # Zero-copy: the states live in the storage that maps the whole shard file.
    sample = reader[0]
    shard_file = tmp_path / manifest["shards"][0]["file"]
    assert sample.aux_hidden.untyped_storage().nbytes() == shard_file.stat().st_size
    assert sample.final_hidden.untyped_storage().data_ptr() == sample.aux_hidden.untyped_storage().data_ptr()
    # ... mapped copy-on-write: writing to a returned tensor never reaches the file.
    before = shard_file.read_bytes()
    sample.aux_hidden.zero_()
    assert shard_file.read_bytes() == before


def test_dump_states_are_the_target_states_fp32(tiny_target, samples, tmp_path):
    """Independent check: hooks written here on a full CausalLM forward of each sample alone."""
    dump_hidden_states(tiny_target, samples[:8], DumpConfig(dtype="float32", **SMALL), tmp_path, progress=False)
    reader = DumpReader(tmp_path)
    model, by_id = tiny_target.model, {s.id: s for s in samples}
    assert_states_match_independent_run(model, reader, by_id, range(len(reader)), atol=1e-5)


def assert_states_match_independent_run(model, reader, by_id, rows, atol):
    layers = model.get_decoder().layers
    for row in rows:
        got = reader[row]
        seen = {}
        handles = [layers[i].register_forward_pre_hook(
            lambda mod, args, kwargs, i=i, seen=seen: seen.__setitem__(
                i, (args[0] if args else kwargs["hidden_states"]).clone()),
            with_kwargs=True) for i in reader.layer_ids]
        try:
            with torch.no_grad():
                logits = model(torch.tensor([by_id[got.id].input_ids])).logits[0]
        finally:
            for h in handles:
                h.remove()
        H = reader.hidden_size
        for k, i in enumerate(reader.layer_ids):
            torch.testing.assert_close(got.aux_hidden[:, k * H:(k + 1) * H].float(), seen[i][0].float(),
                                       rtol=atol, atol=atol)
        with torch.no_grad():
            recomputed = model.lm_head(got.final_hidden.to(model.lm_head.weight.dtype))
        torch.testing.assert_close(recomputed, logits, rtol=atol, atol=atol * 10)


def test_reader_refuses_other_target_layers_or_tokenizer(tiny_target, samples, tmp_path, tiny_tokenizer):
    from tests.support.tiny import build_tiny_llama

    dump_hidden_states(tiny_target, samples[:6], DumpConfig(**SMALL), tmp_path, progress=False)
    other_dir = tmp_path / "other_model"
    build_tiny_llama(len(tiny_tokenizer), seed=1).save_pretrained(other_dir)
    tiny_tokenizer.save_pretrained(other_dir)
    other = load_target(TargetConfig(name="other", path=str(other_dir), gguf_package=None))
    with pytest.raises(ManifestError, match="weights digest mismatch") as e:
        DumpReader(tmp_path, expect_target=other.fingerprint)
    assert str(other_dir) in str(e.value) and str(tmp_path / "manifest.json") in str(e.value)
    with pytest.raises(ManifestError, match=r"layer ids mismatch(.|\n)*\[1, 4, 6\](.|\n)*\[2, 4, 5\]"):
        DumpReader(tmp_path, expect_layer_ids=[1, 4, 6])
    with pytest.raises(ManifestError, match="tokenizer/chat-template digest mismatch"):
        DumpReader(tmp_path, expect_tokenizer_digest="0" * 16)
    DumpReader(tmp_path, expect_target=tiny_target.fingerprint, expect_layer_ids=[2, 4, 5],
               expect_tokenizer_digest=tiny_target.fingerprint["tokenizer_digest"])


# -- resumption, ranks, verification ----------------------------------------------------------------------


def test_resume_rewrites_only_missing_shards(tiny_target, samples, tmp_path):
    cfg = DumpConfig(**SMALL)
    dump_hidden_states(tiny_target, samples, cfg, tmp_path, progress=False)
    reference = shard_bytes(tmp_path)
    (tmp_path / "shard-00001.arrow").unlink()
    (tmp_path / "shard-00002.arrow").write_bytes(b"garbage from a foreign run")
    again = dump_hidden_states(tiny_target, samples, cfg, tmp_path, progress=False)
    manifest = load_manifest(tmp_path)
    assert again.tokens_written == sum(e["tokens"] for e in manifest["shards"][1:3])
    assert shard_bytes(tmp_path) == reference


def test_ranks_write_disjoint_shards_identical_to_one_rank(tiny_target, samples, tmp_path):
    cfg = DumpConfig(**SMALL)
    single, multi = tmp_path / "single", tmp_path / "multi"
    dump_hidden_states(tiny_target, samples, cfg, single, progress=False)
    first = dump_hidden_states(tiny_target, samples, cfg, multi, rank=RankInfo(1, 2, 1), progress=False)
    assert first.manifest is None and not (multi / "manifest.json").exists()
    assert all(int(name[6:11]) % 2 == 1 for name in shard_bytes(multi))
    last = dump_hidden_states(tiny_target, samples, cfg, multi, rank=RankInfo(0, 2, 0), progress=False)
    assert last.manifest is not None and last.tokens_written + first.tokens_written == last.tokens
    assert shard_bytes(multi) == shard_bytes(single)
    assert load_manifest(multi)["shards"] == load_manifest(single)["shards"]


def test_changed_input_replaces_the_old_dump(tiny_target, samples, tmp_path):
    cfg = DumpConfig(**SMALL)
    dump_hidden_states(tiny_target, samples, cfg, tmp_path, progress=False)
    n_before = len(shard_bytes(tmp_path))
    dump_hidden_states(tiny_target, samples[:3], cfg, tmp_path, progress=False)
    reader = DumpReader(tmp_path)
    assert sorted(r.id for r in reader) == sorted(s.id for s in samples[:3])
    assert len(shard_bytes(tmp_path)) == len(load_manifest(tmp_path)["shards"]) < n_before


def test_verify_names_a_corrupted_shard(tiny_target, samples, tmp_path):
    dump_hidden_states(tiny_target, samples, DumpConfig(**SMALL), tmp_path, progress=False)
    assert verify_dump(tmp_path) == []
    path = tmp_path / "shard-00002.arrow"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit inside the states
    path.write_bytes(bytes(data))
    problems = verify_dump(tmp_path)
    assert len(problems) == 1 and problems[0].startswith("shard-00002.arrow: sha256")
    assert DumpReader(tmp_path, verify=False).verify() == problems  # the opt-out opens it; verify() still names it
    with pytest.raises(ManifestError, match=r"shard shard-00002\.arrow: sha256 .*corrupt.*delete that shard file"):
        DumpReader(tmp_path)


# -- the stage --------------------------------------------------------------------------------------------


def stage_config(tmp_path: Path, model_dir, **dump) -> EagletConfig:
    data_file = tmp_path / "conversations.jsonl"
    with open(data_file, "w") as f:
        for i in range(12):
            turns = [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                     for m in make_conversation(i)]
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
        f.write(json.dumps({"id": "prompt-only", "conversations": [{"from": "human", "value": "hello?"}]}) + "\n")
    return EagletConfig(
        stage="dump", name="t", output_root=str(tmp_path / "outputs"),
        target=TargetConfig(name="tiny", path=str(model_dir), gguf_package=None),
        data=DataConfig(sources=[{"path": str(data_file), "format": "sharegpt"}], max_length=512),
        dump=DumpConfig(**{"input": "data", **SMALL, **dump}))


def test_stage_from_data_with_verify(tiny_model_dir, tmp_path):
    from pipeline.hidden_states.run import DumpVerifyError, main

    cfg = stage_config(tmp_path, tiny_model_dir, verify=True)
    summary = main(cfg)
    manifest = load_manifest(cfg.stage_dir("dump"))
    assert manifest["counts"]["samples"] == 12 and manifest["counts"]["skipped_no_assistant_tokens"] == 1
    assert len(DumpReader(cfg.stage_dir("dump"))) == 12 and summary.tokens == manifest["totals"]["tokens"]
    victim = cfg.stage_dir("dump") / manifest["shards"][-1]["file"]
    victim.write_bytes(victim.read_bytes()[:-1] + b"\x00")  # same size, different bytes: only sha256 sees it
    with pytest.raises(DumpVerifyError, match=victim.name):
        main(cfg)


def test_stage_from_regen_checks_its_target(tiny_model_dir, tiny_target, tmp_path):
    from pipeline.hidden_states.run import main

    cfg = stage_config(tmp_path, tiny_model_dir, input="regen")
    regen = cfg.stage_dir("regen")
    (regen / "shards").mkdir(parents=True)
    (regen / "shards" / "shard-00000.jsonl").write_text((tmp_path / "conversations.jsonl").read_text())
    shards = [{"path": "shards/shard-00000.jsonl"}]
    other = dict(tiny_target.fingerprint, weights_digest="f" * 16, source="/elsewhere")
    write_manifest(regen, "regen", {}, {}, {}, target=other, shards=shards)
    with pytest.raises(ManifestError, match="regen target weights digest mismatch(.|\n)*/elsewhere"):
        main(cfg)
    write_manifest(regen, "regen", {}, {}, {}, target=tiny_target.fingerprint, shards=shards)
    main(cfg)
    assert load_manifest(cfg.stage_dir("dump"))["inputs"][0]["path"] == str(regen)
    assert len(DumpReader(cfg.stage_dir("dump"))) == 12


# -- SmolLM2 ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_dump_states_are_the_target_states(smollm2, tmp_path):
    convs = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in [
        ("What does a draft head predict?", "The next tokens, which the target then verifies."),
        ("Name a prime number.", "Seven."),
        ("Why group batches by length?", "Less padding, so fewer wasted positions per forward pass."),
    ]]
    samples = []
    for i, messages in enumerate(convs):
        tok = tokenize_conversation(smollm2.tokenizer, messages)
        samples.append(TokenizedSample(f"s{i}", tok.input_ids, tok.loss_mask))
    dump_hidden_states(smollm2, samples, DumpConfig(dtype="float32"), tmp_path, progress=False)
    reader = DumpReader(tmp_path, expect_target=smollm2.fingerprint, expect_layer_ids=[2, 15, 27])
    assert len(reader) == 3 and reader.hidden_size == 576
    assert_states_match_independent_run(smollm2.model, reader, {s.id: s for s in samples}, range(3), atol=1e-4)
