"""The documents stay navigable and true to the tree: every relative link in README.md, CHANGELOG.md and docs/*.md
reaches a file or folder of the repository (and a `#anchor`, a heading of its page), every docs page is linked from
the README, the README gives exactly two commands (the quickstart and the tests, the latter the one CI runs), and
the package's version is the CHANGELOG's newest release. Docs links break silently; this test is how they don't."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

import hvdtrain

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]

FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"`+[^`]*`+")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (word characters, '-' and ' ' kept), spaces
    to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose(path.read_text()):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    """The link targets of a page's prose (not in code blocks or code spans; a link's text may span lines)."""
    return LINK.findall(CODE_SPAN.sub("", "\n".join(prose(path.read_text()))))


def broken(path: Path, root: Path = REPO) -> list[str]:
    """What is wrong with each relative link of `path` (a page inside `root`)."""
    bad = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not checked here
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target}: no such file or folder {dest}")
        elif not dest.is_relative_to(root):
            bad.append(f"{target}: outside the repository")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            bad.append(f"{target}: no heading with the anchor #{anchor} in {dest.relative_to(root)}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_reaches_a_file_and_a_heading(page: Path) -> None:
    bad = broken(page)
    assert not bad, f"{page.relative_to(REPO)}: broken links:\n" + "\n".join(bad)


def test_the_checker_sees_broken_links_and_anchors(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "outside.md").write_text("# Outside\n")
    (root / "b.md").write_text("## Same\n\n## Same\n")
    (root / "a.md").write_text(
        "# Title: `x --y`\n\n## Same\n\n## Same\n\n```\n# not a heading\n[x](gone.md)\n```\n"
        "[ok](#title-x---y) [ok](b.md#same-1) [ok](sub/) `[code](gone.md)` [a link\nover lines](b.md)\n"
        "[bad](gone.md) [bad](b.md#nowhere) [bad](#not-a-heading) ![img](sub/c.png) [up](../outside.md)\n")
    found = [b.split(": ", 1) for b in broken(root / "a.md", root)]
    assert [target for target, _ in found] == ["gone.md", "b.md#nowhere", "#not-a-heading", "sub/c.png",
                                               "../outside.md"]
    assert found[-1][1] == "outside the repository"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(REPO / t.partition("#")[0]).resolve() for t in links(REPO / "README.md") if t.startswith("docs/")}
    missing = [str(p.relative_to(REPO)) for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs pages the README's table does not link: {missing}"


def test_the_readme_gives_exactly_two_commands_and_ci_runs_the_test_command() -> None:
    """The project's rule: on a fresh machine, one command sets up and runs the quickstart, one runs the tests."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    commands = [line.split("#")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]
    assert commands == ["bash scripts/quickstart.sh", "bash scripts/test.sh"], commands
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert any(line.startswith("bash scripts/test.sh") for line in ci), ci


def releases() -> list[tuple[str, str]]:
    """(version, date) of each `## [X.Y.Z] - YYYY-MM-DD` heading, newest first."""
    text = (REPO / "CHANGELOG.md").read_text()
    return re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", text, flags=re.M)


def test_the_changelog_is_cut_into_releases_newest_first() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## .*$", text, flags=re.M)
    assert headings[0] == "## [Unreleased]", headings
    assert releases() and len(headings) == 1 + len(releases()), (
        f"each heading after [Unreleased] must read ## [X.Y.Z] - YYYY-MM-DD: {headings}")
    versions = [tuple(map(int, v.split("."))) for v, _ in releases()]
    dates = [d for _, d in releases()]
    assert versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions), versions
    assert dates == sorted(dates, reverse=True), dates


def test_the_package_version_is_the_newest_release() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    newest = releases()[0][0]
    assert project["version"] == hvdtrain.__version__ == newest, (project["version"], hvdtrain.__version__, newest)
