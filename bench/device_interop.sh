#!/usr/bin/env bash
# GPU checks of embshard.interop (docs/torchrec.md) on a machine with 2 GPUs, fbgemm-gpu and torchrec in /tmp/site:
# the interop tests under this machine's torchrec (they run TorchRec's DMP on CPU processes), then the three
# migration steps on the 2 GPUs (NCCL): embshard's plan in TorchRec's DMP, the TorchRec model and checkpoint
# trained on in embshard, embshard's checkpoint back into TorchRec; step 3 prints the held-out loss of both.
# Usage: bash bench/device_interop.sh
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import torch, fbgemm_gpu, torchrec; print('torch', torch.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__, 'torchrec', torchrec.__version__, 'gpus', torch.cuda.device_count())"
python3 -m pytest -q -p no:cacheprovider tests/interop 2>&1 | tail -15
out=$(mktemp -d)
for step in step1_plan step2_train step3_export; do
  echo "== $step"
  python3 -m torch.distributed.run --nproc-per-node=2 examples/torchrec/$step.py --out "$out" 2>&1 \
    | grep -v -i "warn\|is_fx_tracing\|^ \|^$" | tail -25
done
