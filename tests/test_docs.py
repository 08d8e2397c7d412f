"""The documentation stays true: the README is a front page whose quick start is two
commands that exist, every relative link of the README, CONTRIBUTING.md, CHANGELOG.md
and docs/ reaches a file (and its ``#anchor`` a heading), and the README's numpy and
torch quick starts run and train.

The link checks read the Markdown files only (no mkdocs needed), with GitHub's slug
rules for anchors; ``python -m mkdocs build --strict`` checks the same links with
MkDocs' rules, and the docstrings' cross-references too. The quick starts run under a
subprocess ``mpiexec`` (serial run only, as in ``tests/test_failures.py``)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from test_failures import run
from test_harness import mpiexec

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 250
PAGES = sorted(
    [README, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")]
)

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # the text, with one level of brackets inside
    r"\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"  # (target "title")
)
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose(markdown: str) -> str:
    """The Markdown without fenced code blocks and code spans (links there are code)."""
    markdown = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), markdown)
    return CODE_SPAN.sub("", markdown)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (MkDocs' toc makes the same one for the headings
    these pages use): the text without markup, lowercased, punctuation dropped,
    every space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for match in HEADING.finditer(FENCE.sub("", path.read_text())):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    text = prose(path.read_text())
    return INLINE_LINK.findall(text) + REFERENCE_DEFINITION.findall(text)


def section(markdown: str, heading: str) -> str:
    """The text of a ``## heading`` section, up to the next heading of that level."""
    start = markdown.index(f"\n## {heading}\n")
    end = markdown.find("\n## ", start + 1)
    return markdown[start : end if end != -1 else len(markdown)]


def code_blocks(markdown: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```[ \t]*$", markdown, re.M | re.S)


# -- the README is a front page ---------------------------------------------------------


def test_the_readme_is_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_the_quick_start_is_two_commands_that_exist() -> None:
    """Exactly two commands, ``scripts/train`` and ``scripts/test``, each with its
    comment; both are executable files of the repository."""
    blocks = code_blocks(section(README.read_text(), "Quick start"), "bash")
    assert len(blocks) == 1, blocks
    commands = blocks[0].splitlines()
    assert [line.split()[0] for line in commands] == ["scripts/train", "scripts/test"], commands
    assert all("#" in line for line in commands), commands
    for command in ("scripts/train", "scripts/test"):
        script = ROOT / command
        assert script.is_file() and os.access(script, os.X_OK), command


# -- every link and anchor resolves -----------------------------------------------------


def test_every_page_is_checked() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "CONTRIBUTING.md", "CHANGELOG.md", "docs/index.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        if SCHEME.match(target) or target.startswith("/"):
            continue  # a URL (not checked offline), or a site-absolute path (mkdocs warns)
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
        elif anchor and file.suffix != ".md":
            broken.append(f"{target}: an anchor into a file that is not Markdown")
    assert not broken, f"{page.relative_to(ROOT)}:\n  " + "\n  ".join(broken)


def test_the_link_checker_sees_links_anchors_and_code() -> None:
    """The checker's own rules, on a sample: links in code are not links, anchors
    follow the heading slugs."""
    sample = "[a](x.md#b) `[c](d.md)`\n```\n[e](f.md)\n```\n![g](h.png)\n[i]: j.md\n"
    text = prose(sample)
    assert INLINE_LINK.findall(text) + REFERENCE_DEFINITION.findall(text) == [
        "x.md#b", "h.png", "j.md"]  # fmt: skip
    assert slug("Surviving a lost rank (`elastic=True`)") == "surviving-a-lost-rank-elastictrue"
    assert slug("A collective that some rank never enters: the watchdog") == (
        "a-collective-that-some-rank-never-enters-the-watchdog")  # fmt: skip
    assert slug("[0.1.0] - 2026-12-04") == "010---2026-12-04"


# -- the README's quick starts run ------------------------------------------------------

QUICK_STARTS = {"numpy": "A numpy model", "torch": "A PyTorch model"}


@pytest.mark.mpi_skip
@pytest.mark.timeout(180)  # (the job's own limit, 120 s, ends it first and says so)
@pytest.mark.parametrize("kind", sorted(QUICK_STARTS))
def test_the_readme_quick_start_runs_and_its_loss_falls(kind: str, tmp_path: Path) -> None:
    if kind == "torch":
        pytest.importorskip("torch")
    blocks = code_blocks(section(README.read_text(), QUICK_STARTS[kind]), "python")
    assert blocks, f"no python block under '## {QUICK_STARTS[kind]}'"
    script = tmp_path / "train.py"
    script.write_text(blocks[0])
    status, out, _ = run([mpiexec(), "-n", "2", sys.executable, str(script)], timeout=120)
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]
    assert status == 0, out
    assert len(losses) >= 3 and losses[-1] < 0.5 * losses[0], out
