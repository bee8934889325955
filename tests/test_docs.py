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

REPO = Path(__file__).resolve().parents[1]
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


def usage_tables(text: str) -> dict[str, set]:
    """Section path -> the names in the first column of its tables, for every usage.md heading that names a
    config section (`regen.openai`, or the root's "Top level"); a section runs to the next heading."""
    tables, current = {}, None
    for _, line in _prose_lines(text):
        heading = HEADING.match(line)
        if heading:
            title = heading.group(2)
            named = re.match(r"`([^`]+)`", title)
            current = "" if title == ROOT_HEADING else named.group(1) if named else None
            if current is not None:
                assert current not in tables, f"docs/usage.md: two sections for {current or ROOT_HEADING!r}"
                tables[current] = set()
        elif current is not None and line.startswith("|"):
            first = line.strip("|").split("|")[0]
            tables[current].update(re.findall(r"`([^`]+)`", first))
    return tables


def _label(path: str) -> str:
    return f"`{path}`" if path else ROOT_HEADING


def test_every_config_field_is_documented_in_usage():
    tables = usage_tables(USAGE.read_text())
    problems = []
    for path, (cls, leaves) in config_sections().items():
        if path not in tables:
            problems.append(f"no section '## {_label(path)}' for {cls.__name__}")
            continue
        problems += [f"{_label(path)}: no row `{name}` ({cls.__name__}.{name})"
                     for name in sorted(leaves - tables[path])]
    assert not problems, "docs/usage.md does not document:\n" + "\n".join(problems)


def test_every_usage_row_is_a_config_field():
    sections = config_sections()
    problems = []
    for path, names in usage_tables(USAGE.read_text()).items():
        if path not in sections:
            problems.append(f"section {_label(path)} is no config section")
            continue
        fields = {f.name for f in dataclasses.fields(sections[path][0])}
        problems += [f"{_label(path)}: row `{name}` is not a field of {sections[path][0].__name__}"
                     for name in sorted(names - fields)]
    assert not problems, "docs/usage.md documents settings that do not exist:\n" + "\n".join(problems)


def test_config_sections_follow_the_dataclasses():
    """The walk itself: it reaches nested sections, dataclasses inside lists, and leaves only."""
    sections = config_sections()
    assert {"", "target", "regen", "regen.openai", "data.sources", "eval.lookup", "tree", "wandb"} <= set(sections)
    assert "data.held_out" not in sections  # the same SourceConfig, documented once under data.sources
    assert "regen" not in sections[""][1] and "stage" in sections[""][1]
    assert "path" in sections["data.sources"][1] and "base_url" in sections["regen.openai"][1]


def test_usage_tables_read_sections_and_first_columns():
    text = ("# t\n## Top level\n| setting | default | meaning |\n|---|---|---|\n| `a` | `1` | x `b` |\n"
            "## `s.t`\n| `c`, `d` | | |\n```\n| `e` | | |\n```\n## Other\n| `f` | | |\n")
    assert usage_tables(text) == {"": {"a"}, "s.t": {"c", "d"}}


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
