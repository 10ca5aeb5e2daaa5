"""Randomized parity fuzzer: random tables, plans mixing every sharding type and tier, random per-rank batches
(0 included), every optimizer, output groups with repeated and unused features, out-of-range ids dropped; outputs
every step, then weights and optimizer state, against the plain-PyTorch reference (fuzz_cases.py draws the cases,
fuzz_check.py trains and compares them).

Environment:
  EMBSHARD_FUZZ_CASES=N     cases to run (default: DEFAULT_CASES on CPU, about 2 minutes on 2 cores)
  EMBSHARD_FUZZ_SEED=S      run only case S (a failure prints its seed)
  EMBSHARD_FUZZ_WORLDS=1,2  world sizes to draw from (default 1-4 on CPU, 1 and 2 GPUs where present)
  EMBSHARD_TEST_DEVICE=cuda the same on GPUs (NCCL; GPU tiers drawn)
"""

from __future__ import annotations

import os
import time

import torch
from dist_harness import test_device as device_kind
from fuzz_cases import draw_case
from fuzz_check import run_cases

DEFAULT_CASES = 150
FIRST_SEED = 1000  # case i of a run has seed FIRST_SEED + i


def _worlds() -> list[int]:
    env = os.environ.get("EMBSHARD_FUZZ_WORLDS")
    if env:
        return [int(w) for w in env.split(",")]
    if device_kind() == "cpu":
        return [1, 2, 3, 4]
    return [n for n in (1, 2) if n <= torch.cuda.device_count()]


def _seeds() -> list[int]:
    if os.environ.get("EMBSHARD_FUZZ_SEED"):
        return [int(os.environ["EMBSHARD_FUZZ_SEED"])]
    return [FIRST_SEED + i for i in range(int(os.environ.get("EMBSHARD_FUZZ_CASES", DEFAULT_CASES)))]


def test_fuzz_parity_with_reference():
    worlds = _worlds()
    cases = [draw_case(s, device_kind(), worlds) for s in _seeds()]
    t0 = time.perf_counter()
    n, failures = run_cases(cases, ",".join(map(str, worlds)))
    per_world = {w: sum(c.world_size == w for c in cases) for w in worlds}
    print(f"fuzz: {n} cases on {device_kind()} (per world size {per_world}) in {time.perf_counter() - t0:.1f} s")
    assert not failures, f"{len(failures)} of {n} fuzz cases failed:\n\n" + "\n".join(failures)
