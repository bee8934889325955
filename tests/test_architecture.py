"""The house's shape, read from the source: every import of `pipeline/` (module level, inside functions and
under TYPE_CHECKING alike), no cycles between modules or between packages, and imports that run one way:
the ground floor under the libraries under the stages under the entry point (docs/design.md)."""
import ast
from collections import defaultdict
from pathlib import Path

import pytest

from tests.support.paths import REPO

# Leaf to root. A unit is a top-level module of pipeline/ or a package of it; it may import units of its own
# floor or below, never above (and the cycle check below rules out cycles within a floor).
FLOORS = {
    "ground": {"choices", "files", "manifest", "precision", "dist", "lock", "tracking", "families",
               "target_files", "redact"},
    "library": {"target", "data", "heads", "decoding"},
    "stage": {"regen", "hidden_states", "train", "eval", "export"},
    "entry": {"config", "run", "doctor", "answers", "results"},
}
FLOOR_OF = {unit: i for i, units in enumerate(FLOORS.values()) for unit in units}


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = modules()


def _imported(module: str, node: ast.AST) -> list[str]:
    """The pipeline modules that one import statement of `module` loads."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package, up level-1 packages
            package = module.split(".")
            if MODULES[module].name != "__init__.py":
                package = package[:-1]
            package = package[:len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    found = []
    for name in names:
        while name and name not in MODULES:  # `import pipeline.heads.config.X` -> its module
            name = name.rpartition(".")[0]
        if name and name != module:
            found.append(name)
    return found


def import_graph() -> dict[str, set[str]]:
    graph = defaultdict(set)
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module].update(_imported(module, node))
    return graph


def unit(module: str) -> str:
    """`pipeline.heads.config` -> `heads`; `pipeline.target` -> `target`; `pipeline` -> `pipeline`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of nodes that reach each other (strongly connected components of more than one node)."""
    reach = {node: reachable(graph, node) for node in graph}
    found = []
    for node in sorted(graph):
        group = sorted({node} | {other for other in reach[node] if node in reach.get(other, ())})
        if len(group) > 1 and group not in found:
            found.append(group)
    return found


GRAPH = import_graph()
UNIT_GRAPH = defaultdict(set)
for _src, _dsts in GRAPH.items():
    for _dst in _dsts:
        if unit(_src) != unit(_dst) and unit(_dst) != "pipeline":
            UNIT_GRAPH[unit(_src)].add(unit(_dst))


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_round_a_cycle():
    assert cycles(GRAPH) == []


def test_no_package_imports_itself_round_a_cycle():
    assert cycles(UNIT_GRAPH) == []


def test_every_unit_has_a_floor():
    assert {unit(m) for m in MODULES} - {"pipeline"} <= set(FLOOR_OF), (
        "a new top-level module or package of pipeline/ needs its floor in FLOORS (and in docs/design.md)")


@pytest.mark.parametrize("floor", list(FLOORS))
def test_imports_run_down_the_floors(floor):
    upward = sorted(f"{src} -> {dst}" for src in FLOORS[floor] for dst in UNIT_GRAPH.get(src, ())
                    if FLOOR_OF.get(dst, -1) > FLOOR_OF[src])
    assert upward == []


def test_no_stage_imports_another_stages_logic_but_its_inputs_reader():
    """Stages talk through their outputs on disk: train never imports eval (its tau probe decodes with
    pipeline.decoding), and nothing imports train, eval or export."""
    assert "eval" not in UNIT_GRAPH["train"]
    for stage in ("train", "eval", "export"):
        importers = sorted(src for src, dsts in UNIT_GRAPH.items() if stage in dsts and src not in FLOORS["entry"])
        assert importers == [], f"{stage} is imported by {importers}"
