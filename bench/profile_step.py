"""Run a benchmark script under torch.profiler and print where rank 0's time goes (not a timing tool: the
profiler slows the step; use it to find host syncs, copies and idle GPU time, then time without it).

    torchrun --nproc-per-node=2 -m bench.profile_step -m bench.embshard_dmp --workload uniform26 --steps 10
    torchrun --nproc-per-node=2 -m bench.profile_step --trace-dir DIR bench/baselines/torchrec_dmp.py --steps 10

Prints, for rank 0: the top operators by self CUDA time and by self CPU time, and the count of device-to-host
syncs; with --trace-dir DIR (before the script) writes each rank's Chrome trace to
DIR/trace_<script>[_<workload>][_rank<r>].json.gz (rank 0's without the suffix). --cuda-only (before the script)
records GPU activity only, so the host runs at its own speed: its trace shows where the GPU idles in a step
(bench/timeline.py --tail-ms, as it has no step annotations).
"""

from __future__ import annotations

import gzip
import os
import runpy
import shutil
import sys

import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    argv = sys.argv[1:]
    out, cuda_only = None, False
    while argv[:1] in (["--trace-dir"], ["--cuda-only"]):
        if argv[0] == "--cuda-only":  # GPU activity only: the host runs at its own speed (no operator records)
            cuda_only, argv = True, argv[1:]
        else:
            out, argv = argv[1], argv[2:]
    module = argv[0] == "-m"  # `-m bench.embshard_dmp ...`: a module of this repository, else a script's path
    if module:
        argv = argv[1:]
    script, args = argv[0], argv[1:]
    sys.argv = [script, *args]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rank = int(os.environ.get("RANK", "0"))
    acts = [] if cuda_only and torch.cuda.is_available() else [ProfilerActivity.CPU]
    acts += [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    with profile(activities=acts) as prof:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    if out:  # every rank's trace: a rank that waits in the exchanges shows where the other spent the time
        name = script.rpartition(".")[2] if module else os.path.splitext(os.path.basename(script))[0]
        if "--workload" in args:
            name += "_" + args[args.index("--workload") + 1]
        path = os.path.join(out, f"trace_{name}" + (f"_rank{rank}" if rank else "") + ".json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(path)
    if rank != 0:
        return
    ev = prof.key_averages()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(ev.table(sort_by=sort, row_limit=30, max_name_column_width=70))
    print(ev.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
    syncs = {e.key: e.count for e in ev if any(s in e.key for s in ("Synchronize", "item", "tolist", "_local_scalar"))}
    print("syncs:", syncs)


if __name__ == "__main__":
    main()
