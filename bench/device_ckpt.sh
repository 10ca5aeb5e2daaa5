#!/usr/bin/env bash
# Checkpoint benchmark on NPROC GPUs (default 2) (hetero124 scaled to ~23 GB, row-wise Adagrad): bash bench/device_ckpt.sh [--scale 0.1]
# Prints save GB/s beside dd, async blocking time, verify GB/s, reload time with and without checksums, peak RSS per
# rank, and a 1-GPU UVM-caching reload's parity;
# then runs tests/checkpoint/ on the GPUs.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DIR=${CKPT_DIR:-/tmp/embshard_ckpt_bench}
mkdir -p "$DIR" && df -h "$DIR" | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -2
python3 -m torch.distributed.run --standalone --nproc-per-node="${NPROC:-2}" bench/checkpoint_bench.py --dir "$DIR" "$@" 2>&1 \
  | tee "${OUT:-/tmp}/ckpt_bench.log" | grep -v -E "Warning|warn\(|return func|is_fx_tracing"
rm -rf "$DIR"
# the checkpoint tests on the GPUs (4-rank loads skip on 2 GPUs): HBM plans, UVM-caching -> HBM -> UVM-caching
EMBSHARD_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -p no:logging tests/checkpoint/ 2>&1 \
  | tee "${OUT:-/tmp}/ckpt_tests.log" | grep -E "passed|failed|skipped|Error|FAILED|assert" | tail -15
