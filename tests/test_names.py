"""Configured names become folders (issue 38): the experiment's `name`, `head.name`, `eval.run_name` and
`eval.compare` must each be one folder name (pipeline/files.py: check_name), and every stage's folder stays
inside output_root (check_inside), so no stage creates or deletes anything outside it."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from pipeline.config import STAGES, EagletConfig
from pipeline.eval.config import EvalConfig
from pipeline.files import NAME_RULE, check_inside, check_name, safe_name
from pipeline.heads import head_config
from pipeline.run import run_stages, to_typed
from tests.support.paths import REPO

# What a hostile name tries: an absolute path, climbing out with `..`, a slash inside.
HOSTILE = ["/etc/cron.d", "..", "../../victim", "a/b", "", ".hidden", "x" * 201, "a b", "-rf"]
# The key that names each stage's folder, with a value that escapes output_root if taken as a path.
STAGE_KEY = {"regen": "name", "dump": "name", "train": "head.name", "eval": "eval.run_name",
             "export": "head.name"}


def compose_named(overrides):
    """tests/support/config.compose_cfg, except that a `name=` override is kept (the CLI's ${hydra:} default
    names the run after the experiment group otherwise)."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        if not any(o.startswith("name=") for o in overrides):
            cfg.name = cfg.hydra.runtime.choices.get("experiment", "demo")
        with open_dict(cfg):
            del cfg["hydra"]
        return to_typed(cfg)


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("value", HOSTILE)
def test_a_name_is_one_folder_name(value):
    with pytest.raises(ValueError) as e:
        check_name(value, "head.name")
    assert str(e.value) == f"head.name={value!r} is not a valid name; {NAME_RULE}"


@pytest.mark.parametrize("value", ["demo", "eagle3", "my-head_v2.1", "run+bf16", "x" * 200, "a..b"])
def test_ordinary_names_pass(value):
    assert check_name(value, "name") == value


@pytest.mark.parametrize("text,want", [("..", "unnamed"), ("my questions (v2)", "my_questions_v2_"),
                                       (".hidden", "hidden"), ("a/../b", "a_.._b"), ("mt_bench", "mt_bench")])
def test_derived_names_are_made_valid(text, want):
    assert safe_name(text) == want and check_name(safe_name(text), "derived")


def test_check_inside_folds_dotdot_and_refuses_the_root_itself(tmp_path):
    assert check_inside(tmp_path / "out" / "a" / "b", tmp_path / "out", "k") == tmp_path / "out" / "a" / "b"
    for bad in (tmp_path / "out" / ".." / "victim", Path("/etc/cron.d"), tmp_path / "out"):
        with pytest.raises(ValueError, match="is not inside output_root"):
            check_inside(bad, tmp_path / "out", "k")


@pytest.mark.parametrize("key", ["name", "head.name", "eval.run_name", "eval.compare"])
@pytest.mark.parametrize("value", ["/etc/cron.d", "../../victim", "a/b"])
def test_a_hostile_name_fails_when_the_config_is_composed(key, value, tmp_path):
    override = f"{key}=[{value}]" if key == "eval.compare" else f"{key}={value}"
    with pytest.raises(ValueError) as e:
        compose_named([f"output_root={tmp_path / 'out'}", override])
    assert f"{key}={value!r} is not a valid name" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_python_level_configs_refuse_hostile_names():
    with pytest.raises(ValueError, match=r"^name='\.\./x' is not a valid name"):
        EagletConfig(name="../x")
    with pytest.raises(ValueError, match=r"^head.name='/etc' is not a valid name"):
        head_config("eagle1", name="/etc")
    with pytest.raises(ValueError, match=r"^eval.run_name='a/\.\.' is not a valid name"):
        EvalConfig(run_name="a/..")


@pytest.mark.parametrize("questions,template", [("/data/../..jsonl", ""), ("/q/my set (v2).jsonl", ""),
                                                ("/x/../../question.jsonl", ""),
                                                ("/q/mt.jsonl", "/tmp/../my template.jinja")])
def test_the_derived_eval_run_name_is_always_a_valid_name(questions, template, tmp_path):
    cfg = compose_named([f"output_root={tmp_path}", f"eval.questions='{questions}'",
                         f"target.chat_template='{template}'"])
    check_name(cfg.eval_run_name, "derived")
    assert check_inside(cfg.stage_dir("eval"), tmp_path, "eval")


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("hostile", ["abs", "dotdot", "slash"])
def test_each_stage_refuses_a_name_changed_after_construction_before_touching_anything(stage, hostile, tmp_path):
    """The second line: a config whose name was changed after its checks ran (Python callers, replace())
    is refused by stage_dir before the stage's lock creates its folder or the stage deletes anything."""
    victim = tmp_path / "victim"
    (victim / stage).mkdir(parents=True)
    (victim / stage / "keep.txt").write_text("mine")
    out = tmp_path / "out"
    value = {"abs": str(victim), "dotdot": "../victim", "slash": "demo/../../victim"}[hostile]
    cfg = EagletConfig(stage=stage, output_root=str(out), head=head_config("eagle3"))
    key = STAGE_KEY[stage]
    if key == "name":
        cfg.name = value
    elif key == "head.name":
        cfg.head.name = value
    else:
        cfg.eval.run_name = value
    before = tree(tmp_path)
    with pytest.raises(ValueError, match="is not a valid name|is not inside output_root"):
        run_stages(cfg)
    assert tree(tmp_path) == before and (victim / stage / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("stage", STAGES)
def test_the_cli_refuses_a_hostile_name_in_one_line_and_writes_nothing_outside_output_root(stage, cli, tmp_path):
    key = STAGE_KEY[stage]
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    value = str(victim) if key == "head.name" else "../victim"
    out = cli([f"stage={stage}", f"output_root={tmp_path / 'out'}", f"{key}={value}"])
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"eaglet: config: ValueError: {key}={value!r} is not a valid name; {NAME_RULE}")
    # Hydra's run folder (its log) is all that is written, inside output_root; no stage made its folder.
    outside = {p for p in tree(tmp_path) if p != "out" and not p.startswith("out/")}
    assert outside == {"victim", "victim/keep.txt"}
    made = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert made and all(".hydra" in p.relative_to(tmp_path / "out").parts for p in made), made
