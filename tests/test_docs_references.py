"""Every repository path the code and docs cite exists.

Scanned: every *.py and *.md file of the repository (hidden directories such as .venv and .git
left out). Checked:

* `docs/<name>.md` — the page exists; with `#anchor`, the page has a heading with that anchor
  (GitHub's rule: lower case, punctuation dropped, spaces to hyphens, -1, -2 ... for repeats);
* `tests/<name>.py` — the file exists;
* relative Markdown links in *.md files (`[text](page.md#anchor)`, images, folders) — the
  target exists, and a `.md` target has the anchor;
* the team's upper-case design document, which lives outside the repository, is cited nowhere:
  the repository's design is docs/design.md.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"__pycache__", "node_modules", "build", "dist", "kubedistill.egg-info"}
OUTSIDE_DESIGN_DOC = "DESIGN" + ".md"  # spelled in two parts so this file does not cite it

# A path from the repository root: not part of a longer path or URL (no word character, dot,
# slash or hyphen right before it).
_ROOT_PATH = r"(?<![\w./-])"
DOCS_REF = re.compile(_ROOT_PATH + r"docs/([\w.-]+\.md)(?:#([\w-]+))?")
TESTS_REF = re.compile(_ROOT_PATH + r"tests/([\w/-]+\.py)\b")
OUTSIDE_REF = re.compile(r"(?<![\w/.-])" + re.escape(OUTSIDE_DESIGN_DOC) + r"\b")
MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`+[^`]*`+")


def repository_files() -> list[Path]:
    """The *.py and *.md files of the repository, without hidden and generated directories."""
    out = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(part.startswith(".") or part in SKIP_DIRS for part in rel.parts[:-1]):
            continue
        if path.suffix in (".py", ".md") and path.is_file():
            out.append(path)
    return out


def slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def _outside_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines of a Markdown text that are not inside a fenced block."""
    lines, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((n, line))
    return lines


@functools.cache
def anchors_of(path: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown file, repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in _outside_fences(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        anchors.add(base if count == 0 else f"{base}-{count}")
    return frozenset(anchors)


def _check_page(page: Path, anchor: str | None, cited: str) -> str | None:
    if not page.is_file():
        return f"{cited}: no such file"
    if anchor and page.suffix == ".md" and anchor not in anchors_of(page):
        return f"{cited}: {page.name} has no heading with anchor #{anchor}"
    return None


def problems_in(path: Path, text: str | None = None) -> list[str]:
    """The broken references of one file, one line each: `<file>:<line>: <reference>: <why>`."""
    if text is None:
        text = path.read_text(encoding="utf-8")
    try:
        where = path.relative_to(ROOT)
    except ValueError:
        where = path
    problems = []

    def report(n: int, problem: str | None) -> None:
        if problem:
            problems.append(f"{where}:{n}: {problem}")

    for n, line in enumerate(text.splitlines(), 1):
        for m in DOCS_REF.finditer(line):
            report(n, _check_page(ROOT / "docs" / m.group(1), m.group(2), m.group(0)))
        for m in TESTS_REF.finditer(line):
            report(n, _check_page(ROOT / "tests" / m.group(1), None, m.group(0)))
        for m in OUTSIDE_REF.finditer(line):
            report(n, f"{m.group(0)}: not part of the repository; cite docs/design.md#<section> instead")
    if path.suffix == ".md":
        for n, line in _outside_fences(text):
            for m in MD_LINK.finditer(INLINE_CODE.sub("", line)):
                target = m.group(1)
                if "://" in target or target.startswith("mailto:"):
                    continue
                file_part, _, anchor = target.partition("#")
                page = (path.parent / file_part).resolve() if file_part else path
                if file_part and not page.exists():
                    report(n, f"link {target}: no such file or directory")
                elif page.is_file():
                    report(n, _check_page(page, anchor or None, f"link {target}"))
    return problems


def test_cited_paths_exist() -> None:
    files = repository_files()
    assert any(p.name == "design.md" for p in files), "docs/design.md is missing"
    problems = [p for path in files for p in problems_in(path)]
    assert not problems, f"{len(problems)} broken reference(s):\n" + "\n".join(problems)


def test_checker_finds_broken_references(tmp_path: Path) -> None:
    """The checker is not vacuous: each kind of broken reference is reported, good ones are not."""
    d, t = "docs", "tests"  # composed, so that this file itself cites nothing broken
    bad_py = tmp_path / "bogus.py"
    bad_py.write_text(
        f'"""See {d}/no-such-page.md, {d}/design.md#no-such-section, {t}/test_no_such_file.py\n'
        f'and {OUTSIDE_DESIGN_DOC} section 2."""\n'
    )
    found = problems_in(bad_py)
    assert len(found) == 4, found
    assert f"{d}/no-such-page.md: no such file" in found[0]
    assert "has no heading with anchor #no-such-section" in found[1]
    assert f"{t}/test_no_such_file.py: no such file" in found[2]
    assert "not part of the repository" in found[3]

    bad_md = tmp_path / "bogus.md"
    bad_md.write_text(
        "# Title\n\n[a](missing.md) [b](#nowhere) [c](#title) [d](https://example.com/x.md)\n"
        "```\n[not a link](missing-in-code.md)\n```\n"
    )
    found = problems_in(bad_md)
    assert len(found) == 2, found
    assert "link missing.md: no such file" in found[0]
    assert "link #nowhere" in found[1]

    good = tmp_path / "good.py"
    good.write_text('"""docs/design.md#staleness, docs/algorithms.md#losses, tests/test_api.py."""\n')
    assert problems_in(good) == []


def test_slug_follows_github() -> None:
    assert slug("Staleness and off-policy correction") == "staleness-and-off-policy-correction"
    assert slug("Throughput (bench/operator.py)") == "throughput-benchoperatorpy"
    assert slug("Task rewards (`useTaskRewards: true`, `advantage: grpo`)") == (
        "task-rewards-usetaskrewards-true-advantage-grpo"
    )
    assert slug("Choosing: speed-ups ([design.md](design.md#x))") == "choosing-speed-ups-designmd"
