"""The house's bounds (docs/testing.md, "Checks that keep it so"): the README is a front door of at most
200 lines, each doc in docs/ stays under its bound, every relative link in them resolves (file and
heading), every artifact folder in docs/ is cited by a doc, and no shipped module's docstring names an
issue (it says what the code does now)."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_LINES = 200
DOC_LINES = 400
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
SHIPPED = ("glance_rt", "engines", "export", "plugins")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """A page's anchors: explicit `<a id>` ones, and GitHub's for its headings (lower case, punctuation
    dropped, spaces to hyphens, repeats numbered)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        out.update(re.findall(r'<a (?:id|name)="([^"]+)"', line))  # explicit anchors
        if not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_readme_is_a_front_door():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines (at most {README_LINES}): move detail into docs/"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_within_bound(doc):
    lines = len(doc.read_text().splitlines())
    assert lines <= DOC_LINES, f"{doc.name} has {lines} lines (at most {DOC_LINES}): split it or cut history"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page):
    broken = []
    for link in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", link):  # http(s), mailto
            continue
        path, _, anchor = link.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{link} (no such heading)")
    assert not broken, f"{page.name}: broken links: {broken}"


def test_every_artifact_folder_is_cited():
    text = "\n".join(p.read_text() for p in PAGES)
    folders = [d.name for d in (ROOT / "docs").iterdir() if d.is_dir()]
    uncited = [f for f in folders if not re.search(rf"\b{re.escape(f)}(/|\)|\s)", text)]
    assert not uncited, f"docs/ folders no doc cites (git history keeps old runs; remove them): {uncited}"


def test_no_module_docstring_names_an_issue():
    named = []
    for package in SHIPPED:
        for path in sorted((ROOT / package).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            if re.search(r"\bissues? \d+", doc):
                named.append(str(path.relative_to(ROOT)))
    assert not named, f"module docstrings naming an issue (say what the code does now): {named}"
