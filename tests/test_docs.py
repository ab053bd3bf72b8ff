"""README.md and docs/ stand on their own: every link and every repository path they name exists
in the checkout, and none points outside it (a clone has no ../shared or other neighbours)."""
from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
# top-level folders and files of the repository; a path written from one of them is a repository path
ROOTS = ("tools", "tests", "e2e", "bench", "kernels", "overlay", "patches", "docs")
TOP_FILES = ("pins.lock", "pyproject.toml", "README.md", ".ci/run")
# made by the tool or on the GPU host, never committed
GENERATED = ("work/", ".venv", "dist/", ".peers", "$OUT", "~/")

# prose that looks like a path: "overlay/kernels files", the git branch `overlay/<pin>`
NOT_PATHS = {"overlay/kernels", "overlay/0.26.0",
             # a path in vLLM's tree (where export-pr places a carried test: docs/CONVENTIONS.md)
             "tests/kernels/attention/test_triton_sparse_mla.py",
             # vLLM's own test files (in its sdist; tools/apply.py upstream-tests extracts them)
             "tests/v1/attention/test_sparse_mla_backends.py", "tests/conftest.py", "tests/utils.py",
             "tests/v1/attention/utils.py", "tests/v1/attention/test_mla_backends.py"}
# results the README names before their first GPU run, each saying so where it is named; an entry
# must go once the file exists (test_pending_results_are_still_pending)
PENDING: dict[str, str] = {  # path -> why it is not in the checkout yet
}

MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(
    r"(?<![\w./$~-])((?:%s)/[\w./*-]*[\w*]|(?:%s)(?![\w.]))" % (
        "|".join(ROOTS), "|".join(re.escape(f) for f in TOP_FILES)))
PLACEHOLDER = re.compile(r"<[^>]*>|\bX\.py\b|\bNNNN\b|\{|\b(OLD|NEW)\b")


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    out = set()
    for line in md.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            title = re.sub(r"[^\w\- ]", "", title)
            out.add(title.replace(" ", "-"))
    return out


def _links(doc: Path):
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for m in MD_LINK.finditer(line):
            yield n, m.group(1)


def _paths(doc: Path):
    text = doc.read_text()
    for n, line in enumerate(text.splitlines(), 1):
        for m in REPO_PATH.finditer(line):
            # a placeholder right after the match (`patches/<pin>/`) makes it a pattern, not a path
            tail = line[m.end():m.end() + 2]
            yield n, m.group(1), tail


def _exists(rel: str) -> bool:
    rel = rel.rstrip("/").rstrip(".")
    if "*" in rel:
        return bool(glob.glob(str(REPO / rel)))
    return (REPO / rel).exists()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_markdown_links_resolve_inside_the_repository(doc):
    bad = []
    for n, target in _links(doc):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if REPO not in dest.parents and dest != REPO:
            bad.append(f"{doc.name}:{n}: {target} points outside the repository")
        elif not dest.exists():
            bad.append(f"{doc.name}:{n}: {target} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{doc.name}:{n}: {target}: no heading #{anchor} in {dest.name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_repository_paths_named_in_docs_exist(doc):
    bad = []
    for n, rel, tail in _paths(doc):
        if "<" in tail or "{" in tail or rel in NOT_PATHS or rel in PENDING:
            continue
        if PLACEHOLDER.search(rel) or any(rel.startswith(g) for g in GENERATED):
            continue
        if not _exists(rel):
            bad.append(f"{doc.relative_to(REPO)}:{n}: {rel}")
    assert not bad, "paths named in the docs that are not in the checkout:\n" + "\n".join(bad)


def test_docs_do_not_send_readers_outside_the_checkout():
    bad = [f"{d.relative_to(REPO)}:{n}" for d in DOCS
           for n, line in enumerate(d.read_text().splitlines(), 1) if "../shared" in line]
    assert not bad, "references to ../shared, which a clone does not have: " + ", ".join(bad)


def test_the_path_scanner_sees_a_missing_file(tmp_path):
    """The checks above would pass vacuously if the scanner matched nothing."""
    doc = tmp_path / "x.md"
    doc.write_text("run `tools/no_such_tool.py` and see [it](../nowhere.md); `kernels/*.py`\n")
    found = [rel for _, rel, _ in _paths(doc)]
    assert found == ["tools/no_such_tool.py", "kernels/*.py"]
    assert not _exists("tools/no_such_tool.py") and _exists("kernels/*.py")
    assert [t for _, t in _links(doc)] == ["../nowhere.md"]


def test_pending_results_are_still_pending():
    done = [rel for rel in PENDING if _exists(rel)]
    assert not done, f"now in the checkout, remove from PENDING in tests/test_docs.py: {done}"


_CONFLICT_MARKER = re.compile(r"^(<{7} |={7}$|>{7} )", re.M)


def _tracked_text_files() -> list[Path]:
    import subprocess

    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    files = [REPO / p for p in out.decode().split("\0") if p]
    return [f for f in files if f.suffix in {".py", ".md", ".toml", ".txt", ".patch", ".sh", ".json", ".cfg"}
            or f.name in {"series", "run"}]


def test_no_merge_conflict_markers():
    # a botched merge once left "=======" inside a module docstring
    bad = [f"{f.relative_to(REPO)}:{s.count(chr(10), 0, m.start()) + 1}"
           for f in _tracked_text_files() if f.is_file()
           for s in [f.read_text(errors="replace")] for m in _CONFLICT_MARKER.finditer(s)]
    assert not bad, f"merge conflict markers in {bad}"


def test_the_conflict_marker_scan_sees_one():
    assert _CONFLICT_MARKER.search("a\n=======\nb") and _CONFLICT_MARKER.search("<<<<<<< HEAD\n")
    assert not _CONFLICT_MARKER.search("  =======  ===\n========\n")
