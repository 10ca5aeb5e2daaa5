"""The TorchRec baseline (bench/baselines/torchrec_dmp.py, unchanged) on embshard's extra workloads.

    torchrun --nproc-per-node=2 -m bench.torchrec_more --workload overflow --hbm-gib 16

Loads the baseline script as a module, adds the workloads of bench/embshard_dmp.py it lacks (same rows, dims,
ids per bag and batch), and runs its main(): TorchRec's planner, DistributedModelParallel and timing loop as is.
"""

from __future__ import annotations

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))
BASELINE = os.environ.get("TORCHREC_BASELINE", os.path.join(HERE, "baselines", "torchrec_dmp.py"))


def main() -> None:
    from bench.workloads import WORKLOADS

    spec = importlib.util.spec_from_file_location("torchrec_dmp", BASELINE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name, workload in WORKLOADS.items():
        mod.WORKLOADS.setdefault(name, workload)
    mod.main()


if __name__ == "__main__":
    main()
