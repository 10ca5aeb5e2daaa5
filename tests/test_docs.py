"""The documentation (README.md, docs/*.md, bench/*.md) speaks of the project only and points at things that exist.

- Words of the environment the team works in, not of the project (who ran what, which machines were available
  when, tracker numbers, output folders of a harness) fail the test with file:line: machines are named by what
  they are ("2 x NVIDIA H100 80GB, one host, NVLink"), goals by what they are.
- Every repository path a document names (`embshard/...`, `tests/...`, `bench/...`, ...) exists (globs match at
  least one file), and every relative Markdown link resolves to a file and, with `#anchor`, to one of its headings.
"""

from __future__ import annotations

import re
from pathlib import Path

import paths
import pytest

ROOT = paths.ROOT


def documents() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "bench").glob("*.md")),
        *sorted((ROOT / "bench" / "results").glob("*/*.md")),
        ROOT / "bench" / "baselines" / "README.md",
        ROOT / "tests" / "README.md",
        ROOT / "data" / "README.md",
    ]


FORBIDDEN = re.compile(
    r"\bsessions?\b|\bworkplace\b|\blent\b|\bwithheld\b|\bissues? #?\d+\b(?!-)|\$OUT\b|\bstag(ed|ing)\b"
    r"|\bhelpers?\b|\bagents?\b|\bdevice tools?\b|\bthe issue\b|\bthe brief\b"
    # goals and targets of the work, not what the product does or measures
    r"|\bthe goal\b|\bgoals?(:| is| of)|\btargets? met\b|\(target:|\bthe target is\b"
    r"|\bacceptance target\b|\bnext target\b"
    # the machinery that ran a command, not the machine it ran on
    r"|\bin this call\b|\brunners?\b|\bmachine of the folder\b",
    re.I,
)


def test_the_words_test_catches_what_it_should():
    bad = [
        "measured in the same device session",
        "the workplace's nvidia-h200 device",
        "no 2-GPU machine was lent",
        "nvidia-h200-x2 was withheld",
        "the goals of issue 12",
        "traces in $OUT",
        "the staged packages",
        "a helper wrote it",
        "the agent ran",
        "the device tool",
        "the goal is 1.15x",
        "goal: 2 M samples/s",
        "the goals of the kernel",
        "(target met)",
        "targets met",
        "(target: 1.3x)",
        "The target is 90% kept",
        "the acceptance target is 2 M samples/s",
        "the next target",
        "measured in this call",
        "until the runner's time limit stopped it",
        "the runners",
        "on the machine of the folder",
    ]
    assert all(FORBIDDEN.search(s) for s in bad), [s for s in bad if not FORBIDDEN.search(s)]
    fine = [
        "2 x NVIDIA H100 80GB, one host, NVLink",
        "Triton issues 16-byte loads",
        "async save #1",
        "OUTPUT",
        "a target outside [0, C) raises IndexError",
        "the target's logit",
        "renames it over the target: a link already in OUT is replaced",
        "the suite's time limit stopped it",
        "calls the planner",
    ]
    assert not [s for s in fine if FORBIDDEN.search(s)]


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_words_of_the_working_environment(doc: Path):
    hits = [
        f"{doc.relative_to(ROOT)}:{i}: {m.group(0)!r} in: {line.strip()[:160]}"
        for i, line in enumerate(doc.read_text().splitlines(), 1)
        for m in FORBIDDEN.finditer(line)
    ]
    assert not hits, "words of the working environment, not of the project (say what the machine or goal is):\n" + (
        "\n".join(hits)
    )


TOP = ("embshard", "tests", "bench", "configs", "launch", "docs", "examples", "requirements", "data", "shared")
PATH = re.compile(r"(?<![\w./~$<-])((?:" + "|".join(TOP) + r")/[\w./*?<>-]*)")
OUTSIDE = re.compile(r"(?<![\w./\]\(])(\.\./[\w./-]+)")  # a path beside the repository, outside any link
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#+ (.*)$", doc.read_text(), re.M)}


def _exists(path: str) -> bool:
    path = path.rstrip(".,:;")
    if "<" in path or ">" in path:  # a pattern such as step_<N>/: its folder must exist
        path = path[: path.index("<")].rpartition("/")[0]
    if any(c in path for c in "*?["):
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_and_links_exist(doc: Path):
    if doc == ROOT / "bench" / "baselines" / "README.md":
        pytest.skip("a byte-identical copy of the shared baselines' README: its paths are those of its source")
    if doc.name == "summary.md" and doc.parent.parent == ROOT / "bench" / "results":
        pytest.skip("a run's record (python -m bench.summarize): the paths its commands printed then")
    bad = []
    in_code_block = False
    for i, line in enumerate(doc.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code_block = not in_code_block
        for m in PATH.finditer(line):
            if not _exists(m.group(1)):
                bad.append(f"{doc.relative_to(ROOT)}:{i}: {m.group(1)} does not exist")
        for m in OUTSIDE.finditer(line):
            bad.append(f"{doc.relative_to(ROOT)}:{i}: {m.group(1)} is outside the repository")
        if in_code_block:
            continue
        for m in LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            where = (doc.parent / file).resolve() if file else doc
            if not where.exists():
                bad.append(f"{doc.relative_to(ROOT)}:{i}: link {target} does not resolve")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                bad.append(f"{doc.relative_to(ROOT)}:{i}: link {target}: no heading #{anchor} in {file or doc.name}")
    assert not bad, "\n".join(dict.fromkeys(bad))


CODE_FORBIDDEN = re.compile(r"\bissues? #?\d+\b(?!-)|\bworkplace\b|\bthe brief\b|\bdevice tools?\b|\$OUT\b", re.I)


def test_code_and_configs_name_no_tracker_numbers():
    """Comments, docstrings and test ids say what a case is ("the hang with an empty local batch"), not which
    tracker entry or working environment it came from (the documents' test above covers the Markdown)."""
    files = [
        *ROOT.glob("embshard/**/*.py"),
        *ROOT.glob("tests/**/*.py"),
        *ROOT.glob("bench/**/*.py"),
        *ROOT.glob("examples/**/*.py"),
        *ROOT.glob("launch/*"),
        *ROOT.glob("configs/**/*.yaml"),
        ROOT / "Makefile",
        ROOT / "pyproject.toml",
    ]
    this = Path(__file__).resolve()
    hits = [
        f"{f.relative_to(ROOT)}:{i}: {m.group(0)!r} in: {line.strip()[:160]}"
        for f in files
        if f.is_file() and f.resolve() != this
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
        for m in CODE_FORBIDDEN.finditer(line)
    ]
    assert not hits, "say what the case or goal is, not its tracker number or where it was run:\n" + "\n".join(hits)
