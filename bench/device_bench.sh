#!/usr/bin/env bash
# Benchmarks on the 2-GPU device machine: TorchRec's DMP baseline and embshard on the same workloads, in one
# session, so the ratios compare like with like. Appends to $OUT/bench.log. Usage: bash bench/device_bench.sh SET
#   SET: uniform26 | hetero124 | overflow
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp}
baseline=shared/baselines/torchrec_dmp.py   # copy of ../shared/baselines, carried to the device
run() { echo "+ torchrun --nproc-per-node=2 $*"; timeout 300 python3 -m torch.distributed.run --nproc-per-node=2 "$@" 2>&1 | grep -E "ms/step|plan|probe|Error|error" | grep -vE "Warn|WARNING"; }
date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
case ${1:-uniform26} in
  uniform26)
    run $baseline --workload uniform26
    run bench/embshard_dmp.py --workload uniform26 --plan simple --mem-probe
    run bench/embshard_dmp.py --workload uniform26 --plan planner ;;
  hetero124)
    run $baseline --workload hetero124 --hbm-gib 130 --force small-dp
    run bench/embshard_dmp.py --workload hetero124 --plan planner
    run bench/embshard_dmp.py --workload hetero124 --plan small-dp ;;
  overflow)
    run bench/embshard_dmp.py --workload overflow --plan planner --hbm-gib 16 ;;
esac 2>&1 | tee -a $out/bench.log
