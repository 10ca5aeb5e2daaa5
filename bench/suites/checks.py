"""The tests suite (the test suite on the GPUs) and the fuzz suite (the parity fuzzer per world size)."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

from bench.suites.common import (
    PYTEST_LINE,
    Machine,
    Step,
    cuda_env,
    last_match,
    pytest,
    step_blocks,
)


# ---- tests ----------------------------------------------------------------------------------------------------
def tests_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    argv = pytest("--durations=30")
    argv.append(f"--junitxml={args.out}/tests_junit.xml")
    if importlib.util.find_spec("pytest_timeout") is not None:
        argv.append(f"--timeout={args.test_timeout}")
    workers = args.test_workers if args.test_workers >= 0 else (8 if m.gpus and m.cpus >= 16 and not args.cpu else 0)
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        # work units to whichever worker is free, longest first: a test alone, or a module that defines a
        # module-scoped fixture (set up once, on one worker): tests/conftest.py's scheduler and order
        argv += ["-n", str(workers), "--dist", "loadgroup"]
    argv += args.pytest_args.split() if args.pytest_args else ["tests"]
    times = f"{args.out}/test_times.txt"
    env = cuda_env(args) | {"EMBSHARD_TEST_TIMES": times}  # kept if the time limit stops it
    return [Step("pytest", argv, env, timeout=600, epilogue=lambda: failures_text(times))]


def failures_text(times: str) -> str:
    """The failures tests/conftest.py wrote to TIMES.failures as they happened, for the log: pytest prints its own
    at the end only (pytest-xdist too), which a run stopped at its time limit never reaches."""
    path = Path(f"{times}.failures")
    text = path.read_text(errors="replace").strip() if path.exists() else ""
    return f"\n--- failed tests as they ended ({path.name}) ---\n{text}\n--- end of {path.name} ---\n" if text else ""


def tests_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    final = last_match(log, PYTEST_LINE) or "no pytest summary line"
    rows = [("pytest", final)]
    times = Path(args.out) / "test_times.txt"
    if times.exists():
        entries = [line.split(None, 3) for line in times.read_text().splitlines() if line.strip()]
        per_file: dict[str, float] = {}
        for sec, _, node, _ in (e for e in entries if len(e) == 4):
            name = node.split("::")[0]
            per_file[name] = per_file.get(name, 0.0) + float(sec)
        top = sorted(per_file.items(), key=lambda kv: -kv[1])[:6]
        rows.append(("slowest files", ", ".join(f"{name} {sec:.0f} s" for name, sec in top) + " (test_times.txt)"))
    failed = list(dict.fromkeys(re.findall(r"^(?:FAILED|ERROR) (\S+)", log, re.M)))  # failures file, then pytest's
    if failed:
        rows.append(("failed", ", ".join(failed[:5]) + (f" and {len(failed) - 5} more" if len(failed) > 5 else "")))
    return rows


# ---- fuzz -----------------------------------------------------------------------------------------------------
def fuzz_plan(args: argparse.Namespace) -> list[tuple[int, int]]:
    spec = args.fuzz or ("2:20,1:10" if args.cpu else "2:300,1:100")
    try:
        return [(int(w), int(n)) for w, n in (item.split(":") for item in spec.split(","))]
    except ValueError:
        raise SystemExit(f"--fuzz {spec!r}: expected WORLD:CASES[,WORLD:CASES...], e.g. 2:300,1:100") from None


def fuzz_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    steps = []
    for world, cases in fuzz_plan(args):
        env = cuda_env(args) | {"EMBSHARD_FUZZ_CASES": str(cases), "EMBSHARD_FUZZ_WORLDS": str(world)}
        argv = pytest("-s", "tests/test_fuzz.py")
        steps.append(Step(f"world {world}, {cases} cases", argv, env, timeout=420, needs_gpus=world))
    argv = pytest("tests/test_fuzz_regressions.py")
    steps.append(Step("regressions", argv, cuda_env(args), timeout=120))
    return steps


def fuzz_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = []
    for label, text in step_blocks(log):
        found = re.findall(r"fuzz: (\d+ random cases, per world size .*?, \d+ failed)", text)
        rows.append((label, found[-1] if found else last_match(text, PYTEST_LINE) or "no summary line (see fuzz.log)"))
        rows += [("failed case", x) for x in re.findall(r"^E +(FUZZ CASE.*)$", text, re.M)[:5]]
    return rows or [("fuzz", "no summary line (see fuzz.log)")]
