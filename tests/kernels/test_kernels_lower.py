"""Every Triton kernel lowers to Triton's IR for a GPU (sm90), checked on the CPU: the launches the CPU suite makes
under Triton's interpreter, recorded in tests/triton_signatures.jsonl, lowered by tests/triton_lower.py where the
kernels are `triton.jit` functions (TRITON_INTERPRET unset). The compiler's front end refuses what the interpreter
runs (a value carried through a loop with another type, and the like): such a kernel fails here, named, instead of
failing only on GPUs. The record covers every kernel of embshard (a `triton.jit` function no other one calls)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import paths
import pytest

pytest.importorskip("triton")

RECORD = paths.TESTS / "triton_signatures.jsonl"
HOW = "record the launches again (tests/triton_lower.py)"


def _jit_functions() -> dict[tuple[str, str], ast.FunctionDef]:
    out = {}
    for path in sorted((paths.ROOT / "embshard").rglob("*.py")):
        module = ".".join(path.relative_to(paths.ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                out[(module, node.name)] = node
    return out


def test_the_record_covers_every_kernel() -> None:
    jit = _jit_functions()
    read = ({getattr(n, "id", None) or getattr(n, "attr", None) for n in ast.walk(node)} - {name}
            for (_, name), node in jit.items())  # fmt: skip
    called = set().union(*read)  # names the jit functions read besides their own: the device functions they call
    kernels = {key for key in jit if key[1] not in called}
    recorded = {(x["module"], x["kernel"]) for x in map(json.loads, RECORD.read_text().splitlines())}
    assert len(kernels) >= 30, sorted(kernels)  # the small tables', the raw ids', the regroup's, the cross layers'
    assert not kernels - recorded, f"kernels without a recorded launch: {sorted(kernels - recorded)}: {HOW}"
    assert not recorded - kernels, f"recorded launches of no kernel of embshard: {sorted(recorded - kernels)}: {HOW}"


def test_every_recorded_launch_lowers_for_a_gpu() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the kernels as jit functions
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, str(paths.TESTS / "triton_lower.py"), str(RECORD)],
        cwd=paths.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    if proc.returncode == 3:
        pytest.skip(out.strip().splitlines()[-1])
    assert proc.returncode == 0, out[-6000:]
    launches = len(RECORD.read_text().splitlines())
    assert f"lowered {launches} of {launches} launch signatures" in out, out[-3000:]
