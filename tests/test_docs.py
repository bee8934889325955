"""The docs hold to the code: every config field has a row in docs/usage.md's table for its section (and every row
names a field), every relative Markdown link points at a file and heading that exist, and the README stays short.
Fast: reads files and dataclasses only."""
from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from pipeline.config import EagletConfig
from pipeline.heads import HEADS, HeadConfig
from tests.support.paths import REPO

USAGE = REPO / "docs" / "usage.md"
ROOT_HEADING = "Top level"  # the usage.md heading of EagletConfig's own fields; the others are `section.path`
README_MAX_LINES = 130


def _held_dataclass(tp) -> type | None:
    """The dataclass a field holds: the type itself, or one inside Optional[...], list[...], dict[..., ...]."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        found = _held_dataclass(arg)
        if found is not None:
            return found
    return None


def config_sections(cls: type = EagletConfig, path: str = "", seen: set | None = None) -> dict[str, tuple[type, set]]:
    """Section path ('' for the root, 'regen.openai', 'data.sources') -> (its dataclass, its leaf field names),
    recursing into every field that holds a dataclass. A class met again (data.held_out holds data.sources'
    entries) is documented once, at its first path."""
    seen = set() if seen is None else seen
    seen.add(cls)
    hints = typing.get_type_hints(cls)
    sections = {path: (cls, set())}
    for f in dataclasses.fields(cls):
        nested = _held_dataclass(hints[f.name])
        if nested is None:
            sections[path][1].add(f.name)
        elif nested not in seen:
            sections.update(config_sections(nested, f"{path}.{f.name}" if path else f.name, seen))
    return sections


def kind_sections() -> dict[str, tuple[type, set]]:
    """`head=<kind>` -> (the kind's options class, the options it adds to HeadConfig's): `head` holds the base
    class in the schema, and each registered kind documents its own options in a section of its own."""
    base = {f.name for f in dataclasses.fields(HeadConfig)}
    return {f"head={kind}": (spec.options_class, {f.name for f in dataclasses.fields(spec.options_class)} - base)
            for kind, spec in HEADS.items()}


def all_sections() -> dict[str, tuple[type, set]]:
    return {**config_sections(), **kind_sections()}


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def usage_tables(text: str) -> dict[str, dict[str, str]]:
    """Section path -> {name in a table row's first column: that row's second (default) column}, for every
    usage.md heading that names a config section (`regen.openai`, or the root's "Top level"); a section runs to
    the next heading."""
    tables, current = {}, None
    for _, line in _prose_lines(text):
        heading = HEADING.match(line)
        if heading:
            title = heading.group(2)
            named = re.match(r"`([^`]+)`", title)
            current = "" if title == ROOT_HEADING else named.group(1) if named else None
            if current is not None:
                assert current not in tables, f"docs/usage.md: two sections for {current or ROOT_HEADING!r}"
                tables[current] = {}
        elif current is not None and line.startswith("|"):
            cells = line.strip().strip("|").split("|")
            default = cells[1] if len(cells) > 1 else ""
            tables[current].update({name: default for name in re.findall(r"`([^`]+)`", cells[0])})
    return tables


def _as_value(text: str):
    """A documented default as the value it spells: true/false, null, a number, else the text."""
    literal = {"true": True, "false": False, "null": None}
    if text in literal:
        return literal[text]
    try:
        return float(text)
    except ValueError:
        return text


def _schema_default(cls: type, name: str):
    """The field's default as documentation spells it (a Choice as its string), or a marker for a list or dict
    default (from a factory), which the default check leaves alone."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default is dataclasses.MISSING:
        return _UNCHECKED
    value = f.default
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    return str(value)


_UNCHECKED = object()


def _typed(value) -> tuple:
    """A value with its kind, so that `true` never passes for 1 nor `0` for false."""
    return type(value).__name__, value


def _label(path: str) -> str:
    return f"`{path}`" if path else ROOT_HEADING


def test_every_config_field_is_documented_in_usage():
    tables = usage_tables(USAGE.read_text())
    problems = []
    for path, (cls, leaves) in all_sections().items():
        if path not in tables:
            problems.append(f"no section '## {_label(path)}' for {cls.__name__}")
            continue
        problems += [f"{_label(path)}: no row `{name}` ({cls.__name__}.{name})"
                     for name in sorted(leaves - set(tables[path]))]
    assert not problems, "docs/usage.md does not document:\n" + "\n".join(problems)


def test_every_usage_row_is_a_config_field():
    sections = all_sections()
    problems = []
    for path, names in usage_tables(USAGE.read_text()).items():
        if path not in sections:
            problems.append(f"section {_label(path)} is no config section")
            continue
        fields = {f.name for f in dataclasses.fields(sections[path][0])}
        problems += [f"{_label(path)}: row `{name}` is not a field of {sections[path][0].__name__}"
                     for name in sorted(set(names) - fields)]
    assert not problems, "docs/usage.md documents settings that do not exist:\n" + "\n".join(problems)


def test_config_sections_follow_the_dataclasses():
    """The walk itself: it reaches nested sections, dataclasses inside lists, and leaves only."""
    sections = config_sections()
    assert {"", "target", "regen", "regen.openai", "data.sources", "eval.lookup", "tree", "wandb"} <= set(sections)
    assert "data.held_out" not in sections  # the same SourceConfig, documented once under data.sources
    assert "regen" not in sections[""][1] and "stage" in sections[""][1]
    assert "path" in sections["data.sources"][1] and "base_url" in sections["regen.openai"][1]
    kinds = kind_sections()  # each kind's own options, not the base's kind/name
    assert "ttt_steps" in kinds["head=eagle3"][1] and "ttt_steps" not in kinds["head=eagle1"][1]
    assert not {"kind", "name"} & kinds["head=medusa"][1] and sections["head"][1] == {"kind", "name"}


def test_usage_tables_read_sections_and_first_columns():
    text = ("# t\n## Top level\n| setting | default | meaning |\n|---|---|---|\n| `a` | `1` | x `b` |\n"
            "## `s.t`\n| `c`, `d` | | |\n```\n| `e` | | |\n```\n## Other\n| `f` | | |\n")
    assert usage_tables(text) == {"": {"a": " `1` "}, "s.t": {"c": " ", "d": " "}}


def test_documented_defaults_are_the_schemas():
    """A default written in backticks is the dataclass's, an empty string is written "empty"; list and dict
    defaults (from factories) are left to the reader."""
    sections = all_sections()
    problems = []
    for path, rows in usage_tables(USAGE.read_text()).items():
        cls = sections[path][0] if path in sections else None
        for name, cell in rows.items():
            if cls is None or name not in {f.name for f in dataclasses.fields(cls)}:
                continue  # reported by test_every_usage_row_is_a_config_field
            written = [_typed(_as_value(v)) for v in re.findall(r"`([^`]*)`", cell)]
            default = _schema_default(cls, name)
            if default == "" and "empty" not in cell:
                problems.append(f"{_label(path)}: `{name}` defaults to the empty string: say \"empty\"")
            elif written and default is not _UNCHECKED and _typed(default) not in written:
                problems.append(f"{_label(path)}: `{name}` documents {cell.strip()}, the schema says {default!r}")
    assert not problems, "docs/usage.md defaults differ from the dataclasses':\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# links


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def heading_anchors(path: Path) -> set:
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens, a
    repeated one suffixed -1, -2, ..."""
    anchors, counts = set(), {}
    for _, line in _prose_lines(path.read_text()):
        heading = HEADING.match(line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(2).strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{counts[slug]}" if slug in counts else slug)
            counts[slug] = counts.get(slug, 0) + 1
    return anchors


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(path: Path):
    """(line number, target) of every link and image in a Markdown file that is no URL."""
    for number, line in _prose_lines(path.read_text()):
        for target in LINK.findall(re.sub(r"`[^`]*`", "code", line)):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):
                yield number, target


def broken_link(source: Path, target: str) -> str | None:
    file, _, anchor = target.partition("#")
    resolved = (source.parent / file).resolve() if file else source
    if not resolved.exists():
        return f"no file {file}"
    if anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
        return f"no heading #{anchor} in {file or source.name}"
    return None


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    problems = [f"{doc.relative_to(REPO)}:{number}: ({target}) {why}"
                for number, target in relative_links(doc) if (why := broken_link(doc, target))]
    assert not problems, "\n".join(problems)


def test_link_checker_sees_broken_links(tmp_path):
    (tmp_path / "b.md").write_text("# A heading: `x.y`\n")
    doc = tmp_path / "a.md"
    doc.write_text("[ok](b.md#a-heading-xy) [gone](c.md) [bad anchor](b.md#nope) [web](https://x.org/y.md)\n"
                   "`[code](c.md)`\n```\n[fenced](c.md)\n```\n")
    verdicts = {t: broken_link(doc, t) for _, t in relative_links(doc)}
    assert verdicts == {"b.md#a-heading-xy": None, "c.md": "no file c.md", "b.md#nope": "no heading #nope in b.md"}


def test_readme_is_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; at most {README_MAX_LINES}: move detail to docs/"
