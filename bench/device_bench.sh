#!/usr/bin/env bash
# Benchmarks on the 2-GPU device machine: TorchRec's DMP baseline and embshard on the same workloads, in one
# session, so the ratios compare like with like. Appends to $OUT/bench.log; saves embshard's plans in $OUT.
# Usage: bash bench/device_bench.sh SET...   SET: uniform26 | hetero124 | overflow   (STEPS=100 by default)
#   TOPOLOGY=FILE: the planner also plans with that `embshard calibrate` file (an extra embshard run per set).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp}
steps=${STEPS:-100}
baseline=bench/baselines/torchrec_dmp.py   # copy of ../shared/baselines
run() { echo "+ torchrun --nproc-per-node=2 $* --steps $steps"; timeout 300 python3 -m torch.distributed.run --nproc-per-node=2 "$@" --steps $steps 2>&1 | grep -E "ms/step|plan|probe|Error|error" | grep -vE "Warn|WARNING"; }
es() { local w=$1; shift; run bench/embshard_dmp.py --workload $w --plan planner --save-plan $out/plan_$w.yaml "$@"
       if [ -n "${TOPOLOGY:-}" ]; then run bench/embshard_dmp.py --workload $w --plan planner --topology $TOPOLOGY --save-plan $out/plan_${w}_calibrated.yaml "$@"; fi; }
for set in ${@:-uniform26}; do
  date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
  case $set in
    uniform26) run $baseline --workload uniform26; es uniform26 ;;
    hetero124) run $baseline --workload hetero124 --hbm-gib 130 --force small-dp; es hetero124 ;;
    overflow)  run bench/torchrec_more.py --workload overflow --hbm-gib 16; es overflow --hbm-gib 16 ;;
  esac 2>&1 | tee -a $out/bench.log
done
