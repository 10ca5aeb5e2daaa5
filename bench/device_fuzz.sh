#!/usr/bin/env bash
# Usage: bash bench/device_fuzz.sh [CASES]   GPU parity fuzzer (tests/test_fuzz.py, default 100 random cases) on 1 GPU, then on 2 GPUs, plus the fuzz regressions; logs in $OUT/fuzz_w*.log; summary table at the end.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EMBSHARD_TEST_DEVICE=cuda EMBSHARD_FUZZ_CASES=${1:-100}
out=${OUT:-/tmp}
rows=()
for W in 1 2; do
  start=$(date +%s)
  EMBSHARD_FUZZ_WORLDS=$W timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_fuzz.py > "$out/fuzz_w$W.log" 2>&1
  rc=$?
  random=$(grep -oE "fuzz: [0-9]+ random cases, per world size .*, [0-9]+ failed" "$out/fuzz_w$W.log" | tail -1)
  tests=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$out/fuzz_w$W.log" | tail -1)
  rows+=("world $W | rc $rc | $(( $(date +%s) - start )) s | ${random:-no summary (see $out/fuzz_w$W.log)} | ${tests}")
  grep -E "^E +FUZZ CASE|^FAILED" "$out/fuzz_w$W.log" | head -20
done
start=$(date +%s)
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_fuzz_regressions.py > "$out/fuzz_regressions.log" 2>&1
rows+=("regressions | rc $? | $(( $(date +%s) - start )) s | $(tail -1 "$out/fuzz_regressions.log")")
echo "---- fuzz summary (EMBSHARD_FUZZ_CASES=$EMBSHARD_FUZZ_CASES per world size) ----"
printf '%s\n' "${rows[@]}"
