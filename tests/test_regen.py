"""Stage regen on the tiny Llama (SmolLM2 for the slow tests): what gets answered, batching, padding
invariance, output readable by the data layer, degenerate answers, resumption after kill -9, two ranks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pipeline.config import EagletConfig
from pipeline.data.bad_records import BadRecordReport
from pipeline.data.chat import stop_token_ids
from pipeline.data.config import DataConfig
from pipeline.data.readers import read_sources
from pipeline.dist import RankInfo, shard_for_rank
from pipeline.manifest import load_manifest
from pipeline.regen import run as regen_run
from pipeline.regen.batching import RegenItem, make_plan, to_item
from pipeline.regen.config import HFGenerateConfig, RegenConfig
from pipeline.regen.hf_backend import HFBackend
from pipeline.regen.shards import RegenDir, RegenStateError, regen_sources
from pipeline.regen.waves import Answer, Request, degenerate_flags, regen_batch
from pipeline.target import TargetConfig, load_target
from tests.support.paths import REPO
from tests.support.regen import QUESTIONS, _cfg, _records


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "input.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    return path


def _shards(cfg: EagletConfig) -> dict[str, bytes]:
    root = cfg.stage_dir("regen") / "shards"
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def _read_back(regen_dir: Path) -> tuple[list[dict], BadRecordReport]:
    report = BadRecordReport()
    return list(read_sources(DataConfig(sources=regen_sources(regen_dir)), report)), report


@pytest.fixture(scope="module")
def tiny_target(tiny_model_dir):
    return load_target(TargetConfig(name="tiny", path=str(tiny_model_dir), gguf_package=None))


# --- what gets answered, and in which batches -------------------------------------------------------------


def test_items_discard_answers_and_keep_every_user_turn():
    conv = {"id": "a", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                                    {"role": "assistant", "content": "old"}, {"role": "user", "content": "u2"}],
            "meta": {"category": "c"}}
    assert to_item(conv, system_prompt="ignored") == RegenItem("a", "S", ("u1", "u2"), {"category": "c"})
    # MT-bench follow-ups (data layer meta) and consecutive user messages are all turns to answer, in order.
    mt = {"id": "m", "messages": [{"role": "user", "content": "t1"}], "meta": {"followup_turns": ["t2", "t3"]}}
    assert to_item(mt, system_prompt="Be kind.") == RegenItem("m", "Be kind.", ("t1", "t2", "t3"), {})
    users = {"id": "u", "messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}
    assert to_item(users).user_turns == ("x", "y") and to_item(users).system is None


def test_plan_groups_by_turns_and_length_and_partitions_deterministically():
    items = [RegenItem(f"i{k}", None, ("q" * n,) * turns) for k, (n, turns) in
             enumerate([(9, 1), (1, 1), (5, 2), (3, 1), (7, 1), (2, 2), (8, 1)])]
    length = lambda item: len(item.user_turns[0])  # noqa: E731
    plan = make_plan(items, batch_size=2, batches_per_shard=2, prompt_length=length)
    ordered = [items[i].id for b in plan.batches for i in b]
    assert ordered == ["i1", "i3", "i4", "i6", "i0", "i5", "i2"]  # one-turn by length, then two-turn
    assert plan.n_shards == 2 and list(plan.shard_batches(1)) == [2, 3]
    assert make_plan(list(items), 2, 2, length) == plan  # same input, same plan
    changed = items[:1] + [RegenItem("i1", None, ("z",))] + items[2:]
    assert make_plan(changed, 2, 2, length).digest != plan.digest  # content is part of the identity
    for world in (1, 2, 3):
        owned = [s for r in range(world) for s in shard_for_rank(plan.n_shards, RankInfo(r, world, 0))]
        assert sorted(owned) == list(range(plan.n_shards))


# --- the hf backend -----------------------------------------------------------------------------------------


def test_padded_batch_answers_equal_answers_alone(tiny_target):
    backend = HFBackend(tiny_target, max_new_tokens=12)
    requests = [Request([{"role": "user", "content": q}], seed=0) for q in QUESTIONS[:5]]
    batched = backend.generate(requests)
    assert len({len(backend.prompt_ids(r.messages)) for r in requests}) > 1  # really padded
    for request, answer in zip(requests, batched):
        assert backend.generate([request])[0] == answer


@pytest.mark.parametrize("options", [HFGenerateConfig(cache="static", pad_to_multiple=16),
                                     HFGenerateConfig(cache="static", compile=True, pad_to_multiple=64)],
                         ids=["static", "static-compiled"])
def test_static_cache_and_compiled_generate_answer_as_the_default(tiny_target, options):
    """In fp32 the static KV cache (rows padded further left, to a multiple of pad_to_multiple) and the
    torch.compile'd forward give the default backend's answers, stop reasons and token counts."""
    requests = [Request([{"role": "user", "content": q}], seed=0) for q in QUESTIONS[:4]]
    default = HFBackend(tiny_target, max_new_tokens=12).generate(requests)
    other = HFBackend(tiny_target, max_new_tokens=12, options=options)
    assert other.generate_kwargs["cache_implementation"] == "static"
    torch._dynamo.reset()
    assert other.generate(requests) == default
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert compiled > 0 if options.compile else compiled == 0  # the compiled path really ran (or did not)


def test_compile_needs_a_static_cache(tiny_target):
    with pytest.raises(ValueError, match="regen.hf.compile needs regen.hf.cache=static"):
        HFBackend(tiny_target, max_new_tokens=4, options=HFGenerateConfig(compile=True))


class OneAtATime:
    """The tiny target answering one request per call from several threads, as a server with parallel slots
    is used (the regen backend contract's `complete`); records when each (conversation, turn) was asked."""

    def __init__(self, backend: HFBackend, concurrency: int, hold=None):
        self.backend, self.concurrency, self.hold = backend, concurrency, hold
        self.events: list[tuple[str, tuple[str, int]]] = []  # ("ask" | "answer", (content, turn)), in order
        self.lock = threading.Lock()

    def prompt_length(self, item):
        return self.backend.prompt_length(item)

    def complete(self, request: Request):
        turn = sum(m["role"] == "user" for m in request.messages) - 1
        key = (request.messages[-1]["content"], turn)
        with self.lock:
            self.events.append(("ask", key))
        if self.hold:
            self.hold(key)
        with self.lock:  # the tiny model is not thread-safe to run twice at once on 2 cores anyway
            answer = self.backend.generate([request])[0]
            self.events.append(("answer", key))
            return answer


def test_per_conversation_schedule_asks_next_turns_without_waiting_and_equals_waves(tiny_target):
    """A concurrent backend gets each conversation's next turn as soon as its answer returns: a long
    conversation's later turns do not wait for a slow batch-mate (under waves they would, and the held
    request below would time out). The records equal the wave schedule's."""
    items = [RegenItem("long", None, ("a1", "a2", "a3")), RegenItem("slow", None, ("b1",)),
             RegenItem("mid", None, ("c1", "c2"))]
    waves = regen_batch(HFBackend(tiny_target, max_new_tokens=8), items, seed=0)
    released = threading.Event()

    def hold(key):  # b1 is answered only once the long conversation has asked its last turn
        if key == ("a3", 2):
            released.set()
        if key == ("b1", 0):
            assert released.wait(timeout=60), "a3 was never asked while b1 was in flight"

    backend = OneAtATime(HFBackend(tiny_target, max_new_tokens=8), concurrency=3, hold=hold)
    streamed = regen_batch(backend, items, seed=0)
    assert streamed.records == waves.records and not streamed.failures
    assert streamed.stats["schedule"] == {"conversation": 1} and waves.stats["schedule"] == {"waves": 1}
    # b1 was answered only after a3 was asked. (Whether b1 was *asked* before a3 depends on when its thread
    # starts: a fast long conversation may ask all its turns first, so that order is not asserted.)
    assert backend.events.index(("answer", ("b1", 0))) > backend.events.index(("ask", ("a3", 2)))
    assert streamed.stats["tokens"] == waves.stats["tokens"] and streamed.stats["turns"] == 6


def test_a_rank_streams_conversations_across_batches_and_equals_the_wave_schedule(tmp_path, tiny_target):
    """Through a concurrent backend a rank's conversations stream across batch boundaries: a conversation of
    the second batch is answered while the first batch's slowest conversation is still held, so a slot
    never waits for the end of a batch. Shards, records and stats equal the wave schedule's (HF greedy)."""
    from pipeline.dist import RankInfo
    from pipeline.regen.batching import make_plan
    from pipeline.regen.run import run_rank

    items = [RegenItem("long", None, ("a1", "a2", "a3")), RegenItem("slow", None, ("b1",)),
             RegenItem("mid", None, ("c1", "c2")), RegenItem("next", None, ("d1",)),
             RegenItem("last", None, ("e1", "e2"))]
    rcfg = RegenConfig(batch_size=2, batches_per_shard=1, max_new_tokens=8, progress=False)
    info = RankInfo(rank=0, world_size=1, local_rank=0)
    wave_dir, stream_dir = RegenDir(tmp_path / "waves"), RegenDir(tmp_path / "stream")
    plan = make_plan(items, rcfg.batch_size, rcfg.batches_per_shard, lambda item: len(item.user_turns))
    batch_of = {items[i].id: b for b, batch in enumerate(plan.batches) for i in batch}
    first_batch_slow = next(items[i] for i in plan.batches[0] if len(items[i].user_turns) == 1)
    later = next(items[i] for i in plan.batches[-1])
    assert batch_of[first_batch_slow.id] < batch_of[later.id]
    waves, pending = run_rank(wave_dir, plan, items, HFBackend(tiny_target, max_new_tokens=8), rcfg, info)
    assert not pending and waves["schedule"] == {"waves": plan.n_batches}
    released = threading.Event()

    def hold(key):  # the first batch's one-turn conversation waits until the last batch has been answered
        if key == (later.user_turns[-1], len(later.user_turns) - 1):
            released.set()
        if key == (first_batch_slow.user_turns[0], 0):
            assert released.wait(timeout=60), "the last batch never started while the first was unfinished"

    backend = OneAtATime(HFBackend(tiny_target, max_new_tokens=8), concurrency=2, hold=hold)
    streamed, pending = run_rank(stream_dir, plan, items, backend, rcfg, info)
    assert not pending and streamed["schedule"] == {"conversation": plan.n_batches}
    assert streamed["tokens"] == waves["tokens"] and streamed["turns"] == waves["turns"]
    read = lambda d: {p.name: p.read_bytes() for p in sorted(d.shards.iterdir())}  # noqa: E731
    assert read(stream_dir) == read(wave_dir) and len(read(wave_dir)) == plan.n_shards


def test_a_batch_killed_midway_resumes_from_its_journal_asking_only_unfinished_conversations(tmp_path,
                                                                                             tiny_target):
    """The per-conversation schedule journals each finished conversation: after an interruption (here the
    third conversation's request raises; a kill -9 may also cut the journal's last line), a rerun asks only
    the conversations the journal lacks, and the batch equals an uninterrupted one."""
    items = [RegenItem("long", None, ("a1", "a2", "a3")), RegenItem("mid", None, ("c1", "c2")),
             RegenItem("slow", None, ("b1",))]
    whole = regen_batch(HFBackend(tiny_target, max_new_tokens=8), items, seed=0)
    out = RegenDir(tmp_path)

    def interrupt(key):
        if key == ("b1", 0):
            raise RuntimeError("killed")

    # concurrency 1: longest first, so long and mid finish before slow is asked
    first = OneAtATime(HFBackend(tiny_target, max_new_tokens=8), concurrency=1, hold=interrupt)
    with pytest.raises(RuntimeError, match="killed"):
        regen_batch(first, items, seed=0, journal=out.journal(0, items))
    with open(out.journal_path(0), "a") as f:
        f.write('{"id": "slow", "elapsed_s": 1.0, "answ')  # the cut last line of a kill
    again = OneAtATime(HFBackend(tiny_target, max_new_tokens=8), concurrency=2)
    resumed = regen_batch(again, items, seed=0, journal=out.journal(0, items))
    assert [key for kind, key in again.events if kind == "ask"] == [("b1", 0)]
    assert resumed.records == whole.records and resumed.stats["tokens"] == whole.stats["tokens"]
    out.save_batch(0, resumed)
    assert not out.journal_path(0).exists()  # the batch file holds every conversation now

    out.journal_path(0).write_text('{"id": "stranger", "elapsed_s": 1.0, "answers": []}\n')
    with pytest.raises(RegenStateError, match="stranger.*not in this batch"):
        out.journal(0, items).load()


def test_stop_tokens_and_degenerate_flags(tiny_target):
    tok = tiny_target.tokenizer
    assert tok.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(tok, tiny_target.model)
    assert degenerate_flags(Answer(" \n", 1, "stop")) == ["empty"]
    assert degenerate_flags(Answer("cut", 8, "length")) == ["truncated"]
    assert degenerate_flags(Answer("fine", 3, "stop")) == []


def test_sampling_is_seeded(tmp_path, tiny_model_dir, source):
    outs = []
    for name, seed in (("s1", 3), ("s2", 3), ("s3", 4)):
        cfg = _cfg(tmp_path, tiny_model_dir, source, name, temperature=1.0, top_p=0.9, seed=seed, limit=4)
        regen_run.main(cfg)
        outs.append(_shards(cfg))
    assert outs[0] == outs[1] and outs[0] != outs[2]


# --- the stage ----------------------------------------------------------------------------------------------


def test_stage_answers_every_turn_and_the_data_layer_reads_it(tmp_path, tiny_model_dir, source):
    cfg = _cfg(tmp_path, tiny_model_dir, source, max_new_tokens=6)
    summary = regen_run.main(cfg)
    out = cfg.stage_dir("regen")
    manifest = load_manifest(out, expect_stage="regen")
    convs, report = _read_back(out)

    n_in = len(_records())
    assert report.total == 0 and sorted(c["id"] for c in convs) == sorted({c["id"] for c in convs})
    assert len(convs) == n_in == summary["written"] == manifest["counts"]["conversations"]
    by_id = {c["id"]: c["messages"] for c in convs}
    assert [m["role"] for m in by_id["sg-multi"]] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in by_id["mt-1"] if m["role"] == "user"] == ["What is 12 times 7?", "Now explain it."]
    assert len(by_id["mt-1"]) == 4 and len(by_id["oa-1"]) == 2
    answers = [m["content"] for msgs in by_id.values() for m in msgs if m["role"] == "assistant"]
    assert not any(a.startswith("ORIGINAL") for a in answers)
    assert manifest["counts"]["turns"] == len(answers) == n_in + 2

    # The tiny random model never says <|im_end|>: every turn is cut at max_new_tokens, and flagged.
    assert manifest["counts"]["degenerate_turns"] == {"truncated": n_in + 2}
    assert manifest["counts"]["tokens_generated"] == 6 * (n_in + 2)
    raw = [json.loads(line) for p in sorted((out / "shards").iterdir()) for line in p.read_text().splitlines()]
    assert {r["id"]: r["regen_flags"]["truncated"] for r in raw}["mt-1"] == [0, 1]
    assert {r["id"]: r.get("category") for r in raw}["mt-1"] == "math"
    fp = manifest["target"]
    assert fp["weights_digest"] and manifest["generation"]["max_new_tokens"] == 6
    assert len(manifest["shards"]) == manifest["plan"]["shards"] == 5 and manifest["errors"] == []

    # A partly written file (what a kill leaves) is never read; a rerun finds every shard done, generates
    # nothing, and clears the leftover.
    before = _shards(cfg)
    (out / "shards" / ".shard-00001.jsonl.999.tmp").write_text('{"id": "half-writ')
    again, again_report = _read_back(out)
    assert again == convs and again_report.total == 0
    assert regen_run.main(cfg)["tokens"] == 6 * (n_in + 2)  # totals come from the done-markers
    assert _shards(cfg) == before


def test_degenerate_answers_can_be_dropped(tmp_path, tiny_model_dir, source):
    cfg = _cfg(tmp_path, tiny_model_dir, source, on_degenerate="drop", limit=5)
    summary = regen_run.main(cfg)
    assert summary["written"] == 0 and summary["dropped_degenerate"] == 5
    assert load_manifest(cfg.stage_dir("regen"))["counts"]["conversations"] == 0


def test_refuses_a_directory_of_another_run(tmp_path, tiny_model_dir, source):
    regen_run.main(_cfg(tmp_path, tiny_model_dir, source, limit=3))
    with pytest.raises(RegenStateError, match="different generation"):
        regen_run.main(_cfg(tmp_path, tiny_model_dir, source, limit=3, max_new_tokens=5))
    summary = regen_run.main(_cfg(tmp_path, tiny_model_dir, source, limit=3, max_new_tokens=5, overwrite=True))
    assert summary["tokens"] == 3 * 5


def test_finalize_partial_writes_a_manifest_over_finished_shards_then_a_rerun_completes(
        tmp_path, tiny_model_dir, source):
    """A long regen can feed the next stages early: finalize_partial lists only finished shards and says
    what is missing; the plain rerun then generates only the missing shard and rewrites the manifest."""
    cfg = _cfg(tmp_path, tiny_model_dir, source, limit=6)  # 3 batches of 2, 2 batches per shard: 2 shards
    full = regen_run.main(cfg)
    regen_dir = cfg.stage_dir("regen")
    complete = load_manifest(regen_dir)
    out = RegenDir(regen_dir)
    out.done_path(1).unlink()  # as if shard 1 had not been finished yet
    out.shard_path(1).unlink()
    partial = regen_run.main(_cfg(tmp_path, tiny_model_dir, source, limit=6, finalize_partial=True))
    manifest = load_manifest(regen_dir)
    assert (manifest["complete"], manifest["shards_missing"]) == (False, 1)
    assert [s["path"] for s in manifest["shards"]] == [complete["shards"][0]["path"]]
    assert manifest["counts"]["conversations"] == partial["written"] == 4 < full["written"] == 6
    assert len(_read_back(regen_dir)[0]) == 4
    regen_run.main(cfg)
    again = load_manifest(regen_dir)
    assert again["complete"] and again["counts"] == complete["counts"] and again["shards"] == complete["shards"]


# --- resumption and ranks (subprocesses) ---------------------------------------------------------------------


def _stage_cmd(cfg: EagletConfig) -> list[str]:
    r = cfg.regen
    return [sys.executable, "-m", "pipeline.run", "stage=regen", f"name={cfg.name}", f"output_root={cfg.output_root}",
            f"target.path={cfg.target.path}", "target.gguf_package=null", "target.name=tiny",
            f"data.sources=[{{path: '{cfg.data.sources[0].path}'}}]", f"regen.batch_size={r.batch_size}",
            f"regen.batches_per_shard={r.batches_per_shard}", f"regen.max_new_tokens={r.max_new_tokens}",
            "regen.progress=false"]


def _env(threads: int, **extra) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **extra}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(key, None)
    env.update(extra)
    return env


def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, tiny_model_dir, source):
    cfg = _cfg(tmp_path, tiny_model_dir, source, name="killed", batch_size=1, batches_per_shard=2,
               max_new_tokens=48)
    out = cfg.stage_dir("regen")
    # The first batch of shard 1 is on disk (so shard 0 is complete) and the second is being generated.
    mid_shard = out / "state" / "batches" / "batch-000002.json"
    proc = subprocess.Popen(_stage_cmd(cfg), cwd=REPO, env=_env(2), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not mid_shard.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert proc.poll() is None, f"finished before the kill: {proc.stderr.read().decode()[-2000:]}"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    shards = list((out / "shards").glob("*.jsonl"))
    batches = list((out / "state" / "batches").glob("*.json"))
    assert len(shards) >= 1 and len(batches) >= 1 and not (out / "manifest.json").exists()
    finished = sum(len(p.read_text().splitlines()) for p in shards) + len(batches)  # one conversation a batch

    resumed = subprocess.run(_stage_cmd(cfg), cwd=REPO, env=_env(2), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    log = resumed.stdout + resumed.stderr  # Hydra logs to stdout
    assert "(resuming)" in log
    # Whole finished batches are skipped: only the rest is generated again.
    assert f"this run: {len(_records()) - finished} conversations" in log

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # as the subprocesses
    try:
        reference = _cfg(tmp_path, tiny_model_dir, source, name="whole", batch_size=1, batches_per_shard=2,
                         max_new_tokens=48)
        regen_run.main(reference)
    finally:
        torch.set_num_threads(before)
    assert _shards(cfg) == _shards(reference)
    ids = [c["id"] for c in _read_back(out)[0]]
    assert len(ids) == len(set(ids)) == len(_records())
    assert not list((out / "state" / "batches").glob("*"))  # folded into their shards


def test_two_ranks_write_disjoint_shards_whose_union_is_the_single_rank_output(tmp_path, tiny_model_dir, source):
    cfg = _cfg(tmp_path, tiny_model_dir, source, name="ranks", batches_per_shard=1)
    # No rank waits for another: rank 0 finishes its shards and exits before rank 1 even starts; rank 1, the
    # last to finish, writes the manifest.
    for env in (_env(1, RANK="0", WORLD_SIZE="2"), _env(1, SLURM_PROCID="1", SLURM_NTASKS="2")):
        p = subprocess.run(_stage_cmd(cfg), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        if env.get("RANK") == "0":
            assert not (cfg.stage_dir("regen") / "manifest.json").exists()
    manifest = load_manifest(cfg.stage_dir("regen"), expect_stage="regen")
    by_rank = {r: {s["path"] for s in manifest["shards"] if s["rank"] == r} for r in (0, 1)}
    assert by_rank[0] and by_rank[1] and not by_rank[0] & by_rank[1]

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank
    try:
        single = _cfg(tmp_path, tiny_model_dir, source, name="single", batches_per_shard=1)
        regen_run.main(single)
    finally:
        torch.set_num_threads(before)
    assert _shards(cfg) == _shards(single)
    assert load_manifest(single.stage_dir("regen"))["counts"] == manifest["counts"]


# --- SmolLM2 --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_padded_batch_matches_alone_and_stops_at_end_of_turn(smollm2):
    backend = HFBackend(smollm2, max_new_tokens=20)
    assert smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>") in backend.stop_ids
    questions = ["Why do cats purr?", "Give me a one-sentence definition of photosynthesis, please, in plain "
                 "English and without any jargon at all.", "Say hi."]
    requests = [Request([{"role": "user", "content": q}], seed=0) for q in questions]
    batched = backend.generate(requests)
    for request, answer in zip(requests, batched):
        alone = backend.generate([request])[0]
        assert alone.text == answer.text, (alone.text, answer.text)
    short = HFBackend(smollm2, max_new_tokens=64).generate([requests[2]])[0]
    assert short.finish_reason == "stop" and short.text.strip() and short.n_tokens < 64
