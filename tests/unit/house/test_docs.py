"""Documentation rules, checked on the source text (no jax import).

* no comment or string in the code cites a document outside the repository (the former design and
  interop contracts, the seed articles): the project's own pages are ``docs/design.md`` and
  ``docs/interop.md``;
* every ``docs/<page>.md#<anchor>`` the code cites exists (page and heading);
* the package's comments cite no issue or session number;
* ``README.md`` has at most 200 lines, its relative links (and those of every page under ``docs/``) point
  at files and headings that exist, it links every ``docs/*.md`` page, and its layout names every
  top-level folder and every subpackage of ``dspark_jax``.

Every violation of a rule is listed in one failure message.
"""

from __future__ import annotations

import io
import json
import re
import tokenize
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CODE_DIRS = ("dspark_jax", "benchmarks", "tests", "serve", "train", "notebooks")
MAX_README_LINES = 200
TOP_LEVEL = ("pyproject.toml", "README.md", "dspark_jax/", "train/", "serve/", "tests/", "notebooks/")
TOP_LEVEL += ("benchmarks/", "docs/", ".ci/")

# Names of the documents that lived beside the repository (never shipped with it). ``../shared/data``
# is where the model files are found at run time, not a document, so it is allowed.
OUTSIDE = re.compile(
    r"\b(?:DESIGN|INTEROP)\.md\b|\bseeds/|(?i:\bseed (?:article|part|appendix|0\d\d)\b)|shared/(?!data\b)"
)
DOC_REF = re.compile(r"\bdocs/([\w./-]+?\.md)(?:#([\w-]+))?")
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def _anchors(page: Path) -> frozenset[str]:
    """The heading anchors of a Markdown page (fenced code skipped; repeats get ``-1``, ``-2``)."""
    seen: dict[str, int] = {}
    anchors = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            anchors.add(f"{slug}-{n}" if n else slug)
            seen[slug] = n + 1
    return frozenset(anchors)


def _code_text(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal of a Python file, or of a notebook's cells."""
    src = path.read_text(encoding="utf-8")
    if path.suffix == ".ipynb":
        cells = json.loads(src)["cells"]
        return [(i, "".join(c.get("source", []))) for i, c in enumerate(cells)]
    if path.suffix == ".sh":
        return [(i, line) for i, line in enumerate(src.splitlines(), 1) if "#" in line]
    keep = (tokenize.COMMENT, tokenize.STRING)
    toks = tokenize.generate_tokens(io.StringIO(src).readline)
    return [(t.start[0], t.string) for t in toks if t.type in keep or t.type == getattr(tokenize, "FSTRING_MIDDLE", -1)]


def _code_files() -> list[Path]:
    files = []
    for d in CODE_DIRS:
        for ext in ("*.py", "*.ipynb", "*.sh"):
            files += [p for p in (ROOT / d).rglob(ext) if "__pycache__" not in p.parts]
    return sorted(p for p in files if p != Path(__file__).resolve())


def _check_ref(page_name: str, anchor: str | None, base: Path) -> str | None:
    """Why a reference to ``page_name`` (relative to ``base``) with ``anchor`` is broken, or None."""
    page = (base / page_name).resolve()
    if not page.is_file():
        return f"no file {page_name}"
    if anchor and page.suffix == ".md" and anchor not in _anchors(page):
        return f"no heading #{anchor} in {page_name}"
    return None


def test_code_cites_no_document_outside_the_repository():
    problems = []
    for path in _code_files():
        for line, text in _code_text(path):
            for m in OUTSIDE.finditer(text):
                problems.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r}")
    assert not problems, "references to documents outside the repository:\n  " + "\n  ".join(problems)


def test_code_cites_existing_docs_sections():
    problems = []
    for path in _code_files():
        for line, text in _code_text(path):
            for m in DOC_REF.finditer(text):
                why = _check_ref(m.group(1), m.group(2), ROOT / "docs")
                if why:
                    problems.append(f"{path.relative_to(ROOT)}:{line}: docs/{m.group(1)}: {why}")
    assert not problems, "broken docs references:\n  " + "\n  ".join(problems)


# The project's working history (issue and session numbers) is nothing a user can look up.
HISTORY = re.compile(r"(?i)\bissues? #?\d+|\bthe exactness issue\b|\bsessions? \d+")


def test_package_comments_cite_no_issue_or_session():
    """The package's comments and docstrings speak to users: they say why, not which issue or
    working session asked for it (docs/journal keeps that history)."""
    files = sorted((ROOT / "dspark_jax").rglob("*.py")) + sorted((ROOT / "dspark_jax").rglob("*.yaml"))
    problems = []
    for path in files:
        lines = _code_text(path) if path.suffix == ".py" else enumerate(path.read_text().splitlines(), 1)
        for line, text in lines:
            problems += [f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r}" for m in HISTORY.finditer(text)]
    assert files and not problems, "history in the package's comments:\n  " + "\n  ".join(problems)


def _md_link_problems(page: Path) -> list[str]:
    problems = []
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    for m in MD_LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked (no network in tests)
            continue
        name, _, anchor = target.partition("#")
        why = _check_ref(name, anchor or None, page.parent) if name else _check_ref(page.name, anchor, page.parent)
        if why:
            problems.append(f"{page.relative_to(ROOT)}: ({target}): {why}")
    return problems


def test_readme_is_short_and_its_links_exist():
    readme = ROOT / "README.md"
    lines = readme.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    pages = [readme] + sorted(p for p in (ROOT / "docs").rglob("*.md"))
    problems = [p for page in pages for p in _md_link_problems(page)]
    assert not problems, "broken links:\n  " + "\n  ".join(problems)
    linked = {m.group(1).partition("#")[0] for m in MD_LINK.finditer(readme.read_text(encoding="utf-8"))}
    missing = [f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_readme_layout_names_every_folder():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    subpackages = sorted(p.name + "/" for p in (ROOT / "dspark_jax").iterdir() if p.is_dir() and p.name[0] != "_")
    missing = [name for name in TOP_LEVEL if f"`{name}`" not in text]
    missing += [f"dspark_jax/{name}" for name in subpackages if f"`{name}`" not in text]
    assert not missing, f"README.md does not explain: {missing}"


def test_slugs_follow_github():
    assert _slug("Verification (lossless)") == "verification-lossless"
    assert _slug("Scale: a device mesh") == "scale-a-device-mesh"
    assert _slug("The `dspark` policy, batch 1") == "the-dspark-policy-batch-1"
