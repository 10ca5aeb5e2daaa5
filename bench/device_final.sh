#!/usr/bin/env bash
# Last device call of a session: tier benchmark on one GPU, bandwidth calibration, and training with the planner.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp}
echo "+ bench/tiers.py --rows 2000000"
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 bench/tiers.py --rows 2000000 2>&1 | grep -vE "Warn|WARN|compat|\[0m|\[33m|^ *$" | tee $out/tiers.log | tail -30
echo "+ embshard calibrate"
timeout 120 python3 -m embshard.cli calibrate --out $out/topology_h200x2.yaml --iters 5 2>&1 | grep -vE "Warn|WARN|compat|\[0m|\[33m|^ *$" | tail -12
echo "+ embshard train configs/dlrm_synthetic.yaml --nproc 2 (planner)"
timeout 150 python3 -m embshard.cli train configs/dlrm_synthetic.yaml --nproc 2 schedule.steps=100 logging.progress_bar=false 2>&1 | grep -vE "Warn|WARN|compat|\[0m|\[33m|^ *$|fx_tracing|return " | tail -14
