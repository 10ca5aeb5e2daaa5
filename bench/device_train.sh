#!/usr/bin/env bash
# `embshard train` on the device's GPUs: the Criteo DLRM on 2 GPUs (NCCL), a checkpoint reload on 1 GPU, and the
# two-tower model with in-batch softmax. Usage: bash bench/device_train.sh
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp}
t() { echo "+ embshard train $*"; timeout 200 python3 -m embshard.cli train "$@" logging.progress_bar=false 2>&1 | grep -vE "Warn|WARN|compat|\[0m|\[33m|^ *$" | tail -12; }
t configs/dlrm_criteo.yaml --nproc 2 | tee $out/train.log
ck=$(ls -t runs/dlrm_criteo/checkpoints/*.pt 2>/dev/null | head -1)
[ -n "$ck" ] && t configs/dlrm_criteo.yaml --nproc 1 checkpoint.resume_from=$ck schedule.epochs=null schedule.steps=1 | tee -a $out/train.log
t configs/two_tower_movielens.yaml --nproc 2 model.two_tower.loss=softmax | tee -a $out/train.log
