#!/usr/bin/env bash
# GPU checks run on the device machine (after ../shared/device/prepare.sh staging): parity tests with NCCL on
# 1 and 2 GPUs, then the demo on GPUs. Usage: bash bench/device_check.sh [pytest args]
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, fbgemm_gpu, torchrec; print('torch', torch.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__, 'torchrec', torchrec.__version__, 'gpus', torch.cuda.device_count())"
EMBSHARD_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider --timeout=300 "${@:-tests}" 2>&1 | tee ${OUT:-/tmp}/tests.log | grep -E "passed|failed|Error|error|FAILED|assert" | tail -40
