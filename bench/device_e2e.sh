#!/usr/bin/env bash
# End-to-end MLPerf DLRM-DCNv2 training on NPROC GPUs (default 2), embshard vs TorchRec's TrainPipelineSparseDist, interleaved (about
# 6 minutes on 2 x H200). Usage, from the repository root: bash bench/device_e2e.sh   (fbgemm/torchrec in /tmp/site)
#   1. 3 pairs, TorchRec first in each: torchrec_dlrm_train.py (sparse_dist, fp32) then embshard fp32 sparse_dist
#      (configs/dlrm_dcnv2_mlperf.yaml, bench/train_e2e.py), 20 warm-up + 60 timed steps each; embshard also reports
#      plan+build time, the held-out AUC after 80 steps and (last pair) a 3-step profile with a Chrome trace
#   2. embshard bf16 dense (pooled fp32), and bf16 dense + bf16 pooled embeddings/exchange (with a profile)
#   3. embshard semi_sync (bf16 + bf16 pooled), embshard tf32 (fp32 storage, TF32 matmuls), embshard none (fp32)
#   4. timeline PNGs of the traces (bench/timeline.py), and the summary table (median ratio and spread)
#   NPROC=1 runs both frameworks on one GPU; SCALE=F keeps F of every table's rows in both (smaller GPUs); SHORT=1 skips step 3
#   optional (LOSS_STEPS=200): bench/loss_curves.py, both frameworks' loss on the same batches (about 1 more minute)
# Every run prints one RESULT line; everything lands in $OUT (log, traces .json.gz, timeline PNGs).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/e2e}
mkdir -p "$OUT"
LOG=$OUT/e2e.log
: >"$LOG"
CFG=configs/dlrm_dcnv2_mlperf.yaml
STEPS=${STEPS:-60}
NPROC=${NPROC:-2}
SCALE_ARGS=()
TR_SCALE_ARGS=()
if [ -n "${SCALE:-}" ]; then  # embshard's --scale multiplies the rows, the baseline's divides them
  SCALE_ARGS=(--scale "$SCALE")
  TR_SCALE_ARGS=(--scale "$(python3 -c "print(1 / float('$SCALE'))")")
fi
WARMUP=${WARMUP:-20}
filter() { grep -vE "Warn|WARN|warn\(|compat|fx_tracing|return func|^ *$|USDT|profiler_st" ; }
torchrec() {
  echo "+ torchrec sparse_dist $*" | tee -a "$LOG"
  timeout 240 python3 -m torch.distributed.run --nproc-per-node="$NPROC" bench/baselines/torchrec_dlrm_train.py \
    --steps "$STEPS" --warmup "$WARMUP" "${TR_SCALE_ARGS[@]}" "$@" 2>&1 | filter | grep -E "RESULT|plan\+build|ms/step|pipelined|rror" | tee -a "$LOG"
}
embshard() {
  echo "+ embshard $*" | tee -a "$LOG"
  timeout 240 python3 bench/train_e2e.py --config "$CFG" --nproc "$NPROC" --steps "$STEPS" --warmup "$WARMUP" --eval "${SCALE_ARGS[@]}" "$@" \
    2>&1 | filter | grep -vE "^samples_per_s=" | tail -12 | tee -a "$LOG"
}
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
for pair in 1 2 3; do
  torchrec
  if [ "$pair" = 3 ]; then
    embshard --tag fp32 --profile-steps 3 --trace "$OUT/trace_fp32.json"
  else
    embshard --tag fp32
  fi
done
embshard --tag bf16 --precision bf16
embshard --tag bf16_pooled_bf16 --precision bf16 lookup.output_dtype=bf16 --profile-steps 3 --trace "$OUT/trace_bf16.json"
if [ -z "${SHORT:-}" ]; then
  embshard --tag semi_sync_bf16 --precision bf16 --pipeline semi_sync lookup.output_dtype=bf16
  embshard --tag tf32 --precision tf32
  embshard --tag none_fp32 --pipeline none
fi
for tr in "$OUT"/trace_*.json; do
  [ -f "$tr" ] || continue
  timeout 60 python3 bench/timeline.py "$tr" --out "${tr%.json}.png" --steps 2 2>&1 | tail -2 | tee -a "$LOG"
  gzip -f "$tr"
done
if [ -n "${LOSS_STEPS:-}" ]; then  # optional: both frameworks' loss on the same batches, full size
  echo "+ loss curves, $LOSS_STEPS steps" | tee -a "$LOG"
  timeout 300 python3 bench/loss_curves.py --config "$CFG" --nproc "$NPROC" --steps "$LOSS_STEPS" --out "$OUT/loss_curves.png" \
    2>&1 | filter | grep -E "^embshard|^torchrec|plot|rror" | tee -a "$LOG"
fi
echo "wall $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
python3 bench/e2e_table.py "$LOG" | tee "$OUT/summary.txt"
