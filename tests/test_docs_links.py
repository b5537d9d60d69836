"""The documentation holds together: every relative link in README.md and docs/*.md reaches a file
that exists (and a ``#section`` a heading of that file), every ``docs/...`` path quoted in code
spans exists, and the README stays a page a newcomer can finish: under 12,000 bytes, opening with
``make demo`` and ``make test``."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
#: the README's size limit in bytes (issue 27: a page a newcomer reads to the end)
README_MAX_BYTES = 12_000

_FENCE = re.compile(r"^(```|~~~)")
# [text](target) and ![alt](target), with an optional "title"; the target has no spaces
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_DOCS_PATH = re.compile(r"^docs/[\w./-]+$")
_SCHEMES = ("http://", "https://", "mailto:", "ftp://")


def markdown_files() -> list[Path]:
    """README.md and every ``docs/*.md``, sorted; the files whose links this module checks."""
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """``(line number from 1, text)`` of ``path`` outside fenced code blocks, where a ``](`` is
    code, not a link."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def heading_slugs(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file: the heading's text without
    Markdown emphasis and code marks, lower-cased, every character but letters, digits, ``-``,
    ``_`` and spaces dropped, spaces turned into ``-``; a repeated slug gets ``-1``, ``-2``, ..."""
    slugs: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))  # a link's text only
        text = "".join(c for c in text.lower() if c in "-_ " or unicodedata.category(c)[0] in "LN")
        slug = text.replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def _named(path: Path) -> str:
    """``path`` relative to the repository when inside it (as a reader would look it up), else whole."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def broken_links(path: Path) -> list[str]:
    """Every relative link of ``path`` that reaches no file, or no heading of its target, as
    ``"<file>:<line>: [<target>] <why>"``; empty when all links hold. External links (http,
    https, mailto, ftp) are not fetched; links inside fenced code or code spans are code."""
    problems = []
    for number, line in prose_lines(path):
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if target.startswith(_SCHEMES):
                continue
            where = f"{_named(path)}:{number}: [{target}]"
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{where} no such file {_named(dest)}")
            elif anchor and dest.suffix == ".md" and anchor not in heading_slugs(dest):
                problems.append(f"{where} no heading with anchor #{anchor} in {_named(dest)}")
    return problems


def test_every_relative_link_reaches_an_existing_file_and_heading() -> None:
    problems = [p for path in markdown_files() for p in broken_links(path)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_docs_paths_quoted_in_code_spans_exist() -> None:
    # a page moved or renamed leaves `docs/old.md` behind in prose that no link check sees
    missing = [
        f"{path.relative_to(REPO)}:{number}: `{span}`"
        for path in markdown_files()
        for number, line in prose_lines(path)
        for _, span in _CODE_SPAN.findall(line)
        if _DOCS_PATH.match(span) and not (REPO / span).exists()
    ]
    assert not missing, "docs paths that do not exist:\n" + "\n".join(missing)


def test_readme_is_under_the_size_limit() -> None:
    size = len(README.read_bytes())
    assert size < README_MAX_BYTES, f"README.md is {size} bytes; move long sections into docs/ (limit {README_MAX_BYTES})"


def test_readme_opens_with_make_demo_then_make_test() -> None:
    lines = [line for line in README.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert lines[0].startswith("# "), "the README starts with its title"
    assert lines[1].strip() == "```bash", f"the first thing after the title is a bash block, not {lines[1]!r}"
    commands = [line.split("#", 1)[0].strip() for line in lines[2:4]]
    assert commands == ["make demo", "make test"], f"the README's first commands are {commands}"


def test_link_checker_names_a_broken_link_and_a_missing_anchor(tmp_path: Path) -> None:
    # the checker itself, on a page of known faults, so a regex that matches nothing cannot pass
    docs = REPO / "docs"
    page = docs / "architecture.md"
    fake = tmp_path / "page.md"
    fake.write_text(
        "# Title\n\n## A `code` heading: yes\n\n"
        f"[ok]({page}) [ok](#title) [ok](#a-code-heading-yes) [ok](https://example.org/x)\n"
        f"[gone]({docs}/no-such-page.md) [bad anchor]({page}#no-such-section) [bad local](#nope)\n"
        "```\n[inside a fence](no-such-file.md)\n```\n`[in a code span](no-such-file.md)`\n",
        encoding="utf-8",
    )
    problems = [p.split(": ", 1)[1] for p in broken_links(fake)]
    assert problems == [
        f"[{docs}/no-such-page.md] no such file docs/no-such-page.md",
        f"[{page}#no-such-section] no heading with anchor #no-such-section in docs/architecture.md",
        f"[#nope] no heading with anchor #nope in {fake}",
    ]
