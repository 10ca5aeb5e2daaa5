#!/usr/bin/env bash
# Where the step's time goes, embshard against TorchRec (torch.profiler, rank 0 of 2 GPUs), and the overflow
# workload on both. Usage: bash bench/device_profile.sh [WORKLOAD...]   (default: uniform26 hetero124)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp}
prof() { echo "+ profile $*"; timeout 200 python3 -m torch.distributed.run --nproc-per-node=2 bench/profile_step.py "$@" --steps 10 2>&1 | grep -vE "Warn|WARN|USDT|fx_tracing|^\*|OMP_NUM" | tee -a $out/profile.log | grep -E "ms/step|syncs|Self CUDA time total|Self CPU time total|plan"; }
for w in ${@:-uniform26 hetero124}; do
  case $w in
    hetero124) prof bench/baselines/torchrec_dmp.py --workload hetero124 --hbm-gib 130 --force small-dp
               prof bench/embshard_dmp.py --workload hetero124 --plan planner ;;
    *)         prof bench/baselines/torchrec_dmp.py --workload $w
               prof bench/embshard_dmp.py --workload $w --plan planner ;;
  esac
done
