"""Recorded test durations, for the order of pytest-xdist's work units (tests/suite_plugin.py: longest first, so that
the slowest tests do not start near the end of a run spread over workers).

tests/durations_gpu.txt holds, per test, its phases' seconds summed (setup, call, teardown; a phase under 0.5 s is
not recorded), from the test_times.txt of a run of the GPU suite (`python -m bench.run tests --out DIR` writes it):

    python tests/durations.py DIR/test_times.txt [MORE/test_times.txt ...] > tests/durations_gpu.txt

(a later file's time of a test replaces an earlier one's). Lines starting with # are comments; a test missing from
the file counts as 0 s (after every recorded test). tests/durations_cpu.txt holds the same from a run of the CPU
suite (`EMBSHARD_TEST_TIMES=DIR/test_times.txt make test`): the order on machines without CUDA, where other tests
are the long ones (command-line runs start new interpreters; no Triton kernel but under its interpreter).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

FILE = Path(__file__).resolve().parent / "durations_gpu.txt"
CPU_FILE = FILE.with_name("durations_cpu.txt")


def default_file(cpu: bool) -> Path:
    """The durations that order a run: the CPU suite's on machines without CUDA, else the GPU suite's."""
    return CPU_FILE if cpu and CPU_FILE.exists() else FILE


def test_id(nodeid: str) -> str:
    """A test's id without pytest-xdist's `@group` suffix (its loadgroup mode adds one to the tests of a group)."""
    return re.sub(r"@[^\]@]*$", "", nodeid)


def from_times(lines: list[str]) -> dict[str, float]:
    """test id -> seconds, from test_times.txt lines ("seconds phase nodeid outcome")."""
    out: dict[str, float] = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 4:
            node = test_id(parts[2])
            out[node] = out.get(node, 0.0) + float(parts[0])
    return out


def load(path: Path = FILE) -> dict[str, float]:
    """test id -> seconds, from a durations file ("seconds nodeid" lines); empty where there is none."""
    if not path.exists():
        return {}
    rows = (line.split(None, 1) for line in path.read_text().splitlines() if line.strip() and line[0] != "#")
    return {node.strip(): float(sec) for sec, node in rows}


def render(durations: dict[str, float]) -> str:
    return "".join(f"{sec:8.2f} {node}\n" for node, sec in sorted(durations.items(), key=lambda kv: (-kv[1], kv[0])))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(
            "usage: python tests/durations.py DIR/test_times.txt [MORE ...] > tests/durations_gpu.txt (or _cpu.txt)"
        )
    merged: dict[str, float] = {}
    for name in sys.argv[1:]:
        merged.update(from_times(Path(name).read_text().splitlines()))
    sys.stdout.write(render(merged))
