#!/usr/bin/env bash
# Benchmarks on the 2-GPU device machine: TorchRec's DMP baseline and embshard on the same workloads, in one
# session, so the ratios compare like with like. Logs go to $OUT (or /tmp). Usage: bash bench/device_bench.sh [which...]
#   which: uniform26 hetero124 (default: both)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp}
baseline=${BASELINE:-shared/baselines/torchrec_dmp.py}
[ -f "$baseline" ] || baseline=bench/torchrec_dmp_copy.py
run() { echo "+ $*"; timeout 420 python3 -m torch.distributed.run --nproc-per-node=2 "$@" 2>&1 | grep -E "ms/step|plan|Error|error" | grep -v Warn; }
date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
for w in "${@:-uniform26 hetero124}"; do
  case $w in
    uniform26)
      run "$baseline" --workload uniform26 | tee -a $out/bench.log
      run bench/embshard_dmp.py --workload uniform26 --plan simple | tee -a $out/bench.log
      run bench/embshard_dmp.py --workload uniform26 --plan planner | tee -a $out/bench.log ;;
    hetero124)
      run "$baseline" --workload hetero124 --hbm-gib 130 --force small-dp | tee -a $out/bench.log
      run bench/embshard_dmp.py --workload hetero124 --plan planner | tee -a $out/bench.log ;;
  esac
done
