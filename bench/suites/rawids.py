"""The rawids suite: raw-id tables against static ones, and TorchRec's managed-collision tables beside them."""

from __future__ import annotations

import argparse

from bench.suites.common import (
    PYTEST_LINE,
    Machine,
    Step,
    cuda_env,
    last_match,
    nproc,
    py,
    pytest,
    results,
    torchrun,
)


# ---- rawids ---------------------------------------------------------------------------------------------------
def rawids_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    """The raw-id tests on the GPUs (the map's step under CUDA's sync debug mode, parity with a static table), the
    map's step profiled in one process (bench/raw_ids_profile.py: kernels, launches and syncs per phase), then
    uniform26 with every table ids: raw (capacity = rows) against static, interleaved: ids within the rows (after
    the first batches every id is resident) and from 10 x rows values (admitting and evicting every step); then the
    same against TorchRec's managed-collision tables (bench/torchrec_mc.py: MCH modules, capacity = rows, against its
    static tables, interleaved) on the same ranks, id spaces and batches."""
    n = nproc(args, m)
    tests = pytest("tests/rawids")
    out = [Step("tests/rawids", tests, cuda_env(args), timeout=400)]
    profile = py() + ["-m", "bench.raw_ids_profile", "--out", f"{args.out}/rawids_profile.txt"]
    profile += ["--scale", "small", "--steps", "2"] if args.cpu else ["--device", "cuda", "--uniform26"]
    out.append(Step("the map's step profiled (one process)", profile, cuda_env(args), timeout=300))
    workload = "tiny" if args.cpu else "uniform26"
    timed = ["--batches", "8", "--rounds", "3", "--steps", str(args.steps or (5 if args.cpu else 20))]
    for space in ("1", "10"):
        argv = torchrun(n) + ["-m", "bench.embshard_dmp", "--workload", workload, "--ids", "both", "--id-space", space]
        out.append(Step(f"{workload} static vs raw, id space {space} x rows", argv + timed, timeout=400,
                        needs_gpus=n))  # fmt: skip
    argv = torchrun(n) + ["-m", "bench.embshard_dmp", "--workload", workload, "--ids", "both", "--id-space", "1"]
    out.append(Step(f"{workload} static vs raw, the map's step eager (EMBSHARD_RAWID_GRAPH=0)", argv + timed,
                    {"EMBSHARD_RAWID_GRAPH": "0"}, timeout=400, needs_gpus=n))  # fmt: skip
    for space in ("1", "10"):
        argv = torchrun(n) + ["-m", "bench.torchrec_mc", "--workload", workload, "--id-space", space]
        out.append(Step(f"{workload} TorchRec static vs managed collisions, id space {space} x rows", argv + timed,
                        timeout=400, needs_gpus=n))  # fmt: skip
    return out


def rawids_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    """Per id space: embshard's raw/static ratio and, beside it, TorchRec's managed-collision/static ratio."""
    rows = [("tests/rawids", last_match(log, PYTEST_LINE) or "no pytest summary line")]
    runs = results(log, "rawids")
    theirs = results(log, "torchrec_mc")
    eager = [r for r in runs if r.get("map_graph") == "0"]
    runs = [r for r in runs if r.get("map_graph") != "0"]
    for space in dict.fromkeys(r.get("id_space") for r in runs + theirs):
        ms = {r["ids"]: float(r["ms_per_step"]) for r in runs if r.get("id_space") == space}
        tr = {r["ids"]: float(r["ms_per_step"]) for r in theirs if r.get("id_space") == space}
        parts, first = [], next(r for r in runs + theirs if r.get("id_space") == space)
        if {"static", "raw"} <= ms.keys():
            raw = next(r for r in runs if r.get("id_space") == space and r["ids"] == "raw")
            parts.append(f"embshard static {ms['static']:.2f} ms, raw {ms['raw']:.2f} ms "
                         f"({ms['raw'] / ms['static']:.2f}x; admitted {raw.get('admitted')}, "
                         f"evicted {raw.get('evicted')})")  # fmt: skip
        if {"static", "mc"} <= tr.keys():
            parts.append(f"TorchRec static {tr['static']:.2f} ms, managed collisions {tr['mc']:.2f} ms "
                         f"({tr['mc'] / tr['static']:.2f}x)")  # fmt: skip
        if parts:
            rows.append((f"{first['workload']} world {first['world']}, id space {space} x rows", "; ".join(parts)))
    ms = {r["ids"]: float(r["ms_per_step"]) for r in eager}
    if {"static", "raw"} <= ms.keys():
        rows.append(("the map's step eager (EMBSHARD_RAWID_GRAPH=0), id space 1 x rows",
                     f"embshard static {ms['static']:.2f} ms, raw {ms['raw']:.2f} ms "
                     f"({ms['raw'] / ms['static']:.2f}x)"))  # fmt: skip
    return rows
