"""docs/ stays true to the code that points at it.

- Every citation "docs/<file>.md §N" in the code (zaya_jax/, configs/, benchmarks/, launch/,
  tests/, the READMEs) resolves to a heading carrying §N in that file; a range "§1-2" resolves at both ends.
- Every docs/ path the code names exists, and a section is cited with "§" (not "docs/model.md 2.1").
- Every "SPEC §N" citation (the model spec the code cites today, outside the repository) has its
  section in docs/model.md, under the same number, so rewriting "SPEC §N" to "docs/model.md §N"
  keeps every reference true.
- Inside docs/, citations "model.md §N" and links to other docs files resolve.
- In docs/ and every README, a relative link resolves to a file, and its #anchor to a heading there.
- README.md stays a front door (<= 150 lines) and benchmarks/README.md a manual (<= 600 lines).
"""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ("zaya_jax", "configs", "benchmarks", "launch", "tests")
SELF = pathlib.Path(__file__).name  # its fake repository's broken references are on purpose
SUFFIXES = {".py", ".md", ".sh", ".txt", ".toml", ".cfg"}
SECTION = r"§\s*(\d+(?:\.\d+)*)(?:\s*[-–]\s*§?\s*(\d+(?:\.\d+)*))?"
DOC_CITATION = re.compile(r"(?<![\w/.-])docs/([\w./-]+?\.md)\s*" + SECTION)
LOCAL_CITATION = re.compile(r"(?<![\w/.-])(?:docs/)?([\w-]+\.md)\s*" + SECTION)
SPEC_CITATION = re.compile(r"\bSPEC(?:\.md)?\s*§?\s*(\d+(?:\.\d+)*)(?:\s*-\s*(\d+(?:\.\d+)*))?")
BARE_NUMBER = re.compile(r"(?<![\w/.-])docs/([\w./-]+?\.md)\s+(\d+(?:\.\d+)+)")  # "docs/model.md 2.1.8"
DOC_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]*[\w/]")
DOC_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
HEADING = re.compile(r"^#{1,6}\s+§(\d+(?:\.\d+)*)(?=\s|$)", re.MULTILINE)


def code_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The files whose references to docs/ must hold: the scanned trees and the READMEs."""
    files = [
        p
        for d in SCANNED
        for p in sorted((root / d).rglob("*"))
        if p.suffix in SUFFIXES and p.is_file() and p.name != SELF
    ]
    return files + sorted(p for p in root.glob("*.md") if p.is_file())


def sections(doc: pathlib.Path) -> set[str]:
    """The section numbers of a markdown file's headings ("## §2.1.8 Padding ..." -> "2.1.8")."""
    return set(HEADING.findall(doc.read_text())) if doc.is_file() else set()


def _where(path: pathlib.Path, root: pathlib.Path, text: str, pos: int) -> str:
    return f"{path.relative_to(root)}:{text.count(chr(10), 0, pos) + 1}"


def _cited(match: re.Match) -> list[str]:
    return [n for n in match.groups()[-2:] if n]


def code_problems(root: pathlib.Path) -> list[str]:
    """Unresolved docs citations, missing docs paths and SPEC sections model.md lacks, one line each."""
    problems = []
    model_sections = sections(root / "docs" / "model.md")
    for path in code_files(root):
        text = path.read_text(errors="replace")
        for m in DOC_CITATION.finditer(text):
            have = sections(root / "docs" / m.group(1))
            for number in _cited(m):
                if number not in have:
                    problems.append(
                        f"{_where(path, root, text, m.start())}: docs/{m.group(1)} has no heading §{number}"
                    )
        for m in BARE_NUMBER.finditer(text):
            problems.append(f"{_where(path, root, text, m.start())}: write docs/{m.group(1)} §{m.group(2)}")
        for m in DOC_PATH.finditer(text):
            if not (root / m.group(0).rstrip(".")).exists():
                problems.append(f"{_where(path, root, text, m.start())}: {m.group(0)} does not exist")
        for m in SPEC_CITATION.finditer(text):
            for number in _cited(m):
                if number not in model_sections:
                    problems.append(
                        f"{_where(path, root, text, m.start())}: SPEC §{number} is not a section of docs/model.md"
                    )
    return problems


def docs_problems(root: pathlib.Path) -> list[str]:
    """Inside docs/: citations of another docs file's sections and relative links, one line each."""
    problems = []
    docs = root / "docs"
    for path in sorted(docs.rglob("*.md")):
        text = path.read_text()
        for m in LOCAL_CITATION.finditer(text):
            have = sections(docs / m.group(1))
            for number in _cited(m):
                if number not in have:
                    problems.append(
                        f"{_where(path, root, text, m.start())}: {m.group(1)} has no heading §{number}"
                    )
        for m in DOC_LINK.finditer(text):
            target = m.group(1)
            if "://" not in target and not (path.parent / target).exists():
                problems.append(f"{_where(path, root, text, m.start())}: link to {target} does not resolve")
    return problems


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: pathlib.Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {anchor(h) for h in re.findall(r"^#{1,6}\s+(.+)$", text, re.MULTILINE)}


def link_problems(root: pathlib.Path) -> list[str]:
    """Relative links of docs/ and the READMEs whose file or #anchor does not exist, one line each."""
    problems = []
    files = sorted((root / "docs").rglob("*.md")) + sorted(root.glob("*.md")) + sorted(root.glob("*/README.md"))
    for path in files:
        text = path.read_text()
        for m in re.finditer(r"\]\(([^)\s]*)\)", text):
            target, _, frag = m.group(1).partition("#")
            if "://" in target or target.startswith("mailto:"):
                continue
            dest = (path.parent / target) if target else path
            if not dest.exists():
                problems.append(f"{_where(path, root, text, m.start())}: link to {m.group(1)} does not resolve")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                problems.append(f"{_where(path, root, text, m.start())}: {dest.name} has no heading #{frag}")
    return problems


def test_links_resolve():
    problems = link_problems(REPO)
    assert not problems, "\n".join(problems)


def test_readmes_stay_short():
    lines = {p: len((REPO / p).read_text().splitlines()) for p in ("README.md", "benchmarks/README.md")}
    assert lines["README.md"] <= 150 and lines["benchmarks/README.md"] <= 600, lines


def test_code_references_to_docs_resolve():
    problems = code_problems(REPO)
    assert not problems, "\n".join(problems)


def test_docs_cross_references_resolve():
    problems = docs_problems(REPO)
    assert not problems, "\n".join(problems)


def test_model_md_sections_are_unique():
    numbers = HEADING.findall((REPO / "docs" / "model.md").read_text())
    assert len(numbers) == len(set(numbers)), sorted(n for n in numbers if numbers.count(n) > 1)


def test_broken_references_are_caught(tmp_path):
    """A fake repository: one good citation, and one of each kind of broken reference."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "model.md").write_text(
        "# Model\n\n## §1 Sizes\n\n### §2.1.8 Padding\n\nSee [x](gone.md).\n"
    )
    (tmp_path / "zaya_jax").mkdir()
    (tmp_path / "zaya_jax" / "a.py").write_text(
        '"""docs/model.md §2.1.8 and docs/model.md §1-2."""\n'
        "# docs/model.md §9 and docs/extra.md §1; see docs/notes/\n"
        "x = 1  # SPEC §2.1.8, SPEC 2.1.5\n"
        "y = 2  # docs/model.md 2.1.8\n"
    )
    assert code_problems(tmp_path) == [
        "zaya_jax/a.py:1: docs/model.md has no heading §2",
        "zaya_jax/a.py:2: docs/model.md has no heading §9",
        "zaya_jax/a.py:2: docs/extra.md has no heading §1",
        "zaya_jax/a.py:4: write docs/model.md §2.1.8",
        "zaya_jax/a.py:2: docs/extra.md does not exist",
        "zaya_jax/a.py:2: docs/notes/ does not exist",
        "zaya_jax/a.py:3: SPEC §2.1.5 is not a section of docs/model.md",
    ]
    assert docs_problems(tmp_path) == ["docs/model.md:7: link to gone.md does not resolve"]
    (tmp_path / "README.md").write_text("[m](docs/model.md#1-sizes) [p](docs/model.md#gone) [q](nothere.md)\n")
    assert link_problems(tmp_path) == [
        "docs/model.md:7: link to gone.md does not resolve",
        "README.md:1: model.md has no heading #gone",
        "README.md:1: link to nothere.md does not resolve",
    ]
