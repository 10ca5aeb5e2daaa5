"""The repository's layout: the top level holds only the project's own files, and no module of the package grows
past MAX_LINES lines (a longer one is split along its seams)."""

from __future__ import annotations

import shutil
import subprocess

import paths
import pytest

ROOT = paths.ROOT

TOP_LEVEL = {
    ".ci": "continuous-integration scripts",
    ".gitignore": "what git leaves out",
    "Makefile": "install, test, docs and lint targets",
    "README.md": "the project's introduction",
    "bench": "benchmarks and their recorded results",
    "configs": "example training and planner configurations",
    "data": "small data sets the examples and tests read",
    "docs": "the documentation",
    "embshard": "the package",
    "examples": "runnable examples",
    "launch": "multi-node launch scripts",
    "pyproject.toml": "the package's metadata and tool settings",
    "requirements": "pinned dependency sets",
    "tests": "the test suite",
}
"""Every name the top level may hold, and what it is for."""

MAX_LINES = 500


def tracked_top_level() -> set[str]:
    """The first path component of every file git tracks in the repository."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout of the repository (git ls-files)")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return {p.split("/", 1)[0] for p in out.decode().split("\0") if p}


def test_top_level_holds_only_the_projects_files():
    stray = sorted(tracked_top_level() - set(TOP_LEVEL))
    assert not stray, (
        f"files at the repository's top level that are not the project's: {stray}; move them where they belong "
        "(docs/, bench/, tests/...) or delete them, or add a real new top-level entry to TOP_LEVEL in this test"
    )


def long_modules(max_lines: int = MAX_LINES) -> list[str]:
    """The package's Python files longer than `max_lines` lines, as 'path: lines'."""
    out = []
    for path in sorted((ROOT / "embshard").rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > max_lines:
            out.append(f"{path.relative_to(ROOT)}: {n}")
    return out


def test_long_modules_reads_the_package():
    assert len(long_modules(max_lines=1)) > 50, "the scan should see the package's modules (most over one line)"
    assert not long_modules(max_lines=10**9)


def test_no_module_over_max_lines():
    long = long_modules()
    assert not long, f"modules over {MAX_LINES} lines (split each along its seams): {long}"
