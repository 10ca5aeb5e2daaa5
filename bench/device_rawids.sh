#!/usr/bin/env bash
# Raw-id tables on GPUs (after ../shared/device/prepare.sh staging): the raw-id tests with CUDA (the map's step
# under CUDA's sync debug mode, parity with a static table), then the uniform26 embedding step with every table
# ids: raw (capacity = rows) against the static tables, interleaved on the same batches: ids within the rows
# (after the first batches, every id is resident) and ids from 10 x rows values (admitting and evicting every step).
# Usage: NPROC=1 bash bench/device_rawids.sh
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import torch, fbgemm_gpu, torchrec; print('torch', torch.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__, 'torchrec', torchrec.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name())" || exit 3
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  EMBSHARD_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/rawids 2>&1 | tail -25
fi
N=${NPROC:-1}
for space in 1 10; do
  torchrun --nproc-per-node=$N bench/embshard_dmp.py --workload uniform26 --ids both --rounds ${ROUNDS:-3} \
    --steps ${STEPS:-20} --id-space $space --batches 8 2>&1 | grep -E "^embshard|^plan|^raw ids|Error|error" | grep -v Warning
done
