#!/usr/bin/env bash
# Usage: bash bench/device_gpu1.sh STAGE   One-GPU checks and benchmarks on the device machine (fbgemm/torchrec in /tmp/site).
#   check:  kernel parity on the GPU (bench/kernels.py --check) and the one-GPU test files that touch kernels and tiers
#   tests:  the GPU test suite on one GPU (distributed tests needing 2 GPUs skip themselves)
#   bench:  bench/kernels.py and bench/cross_entropy.py (timings, % of measured copy bandwidth)
#   fuzz:   the parity fuzzer, 100 random cases on 1 GPU
# Logs go to $OUT/<stage>*.log; the last lines are a summary.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
case "${1:-check}" in
  check)
    timeout 200 python3 bench/kernels.py --check > "$out/check_kernels.log" 2>&1; echo "kernels --check rc $?"
    grep -E "FAIL|ALL PASS" "$out/check_kernels.log" | head -30
    EMBSHARD_TEST_DEVICE=cuda timeout 330 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernels_small_tables.py \
      tests/kernels/test_kernels_regroup.py tests/kernels/test_kernels_data_parallel.py tests/kernels/test_cross_entropy.py tests/lookup/test_tiers_gpu.py \
      tests/sharding/test_regroup.py > "$out/check_tests.log" 2>&1; echo "kernel/tier tests rc $?"
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/check_tests.log" | tail -15 ;;
  tests)
    EMBSHARD_TEST_DEVICE=cuda timeout 560 python3 -m pytest -q -p no:cacheprovider tests --deselect tests/test_train.py \
      --ignore tests/test_fuzz.py --ignore tests/kernels/test_kernels_interpret.py -x > "$out/tests.log" 2>&1; echo "tests rc $?"
    grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -25 ;;
  bench)
    timeout 330 python3 bench/kernels.py > "$out/bench_kernels.log" 2>&1; echo "kernels rc $?"; tail -45 "$out/bench_kernels.log"
    timeout 200 python3 bench/cross_entropy.py > "$out/bench_xent.log" 2>&1; echo "cross_entropy rc $?"; tail -20 "$out/bench_xent.log" ;;
  fuzz)
    EMBSHARD_TEST_DEVICE=cuda EMBSHARD_FUZZ_CASES=100 EMBSHARD_FUZZ_WORLDS=1 timeout 500 python3 -m pytest -q -s \
      -p no:cacheprovider tests/test_fuzz.py tests/test_fuzz_regressions.py > "$out/fuzz_w1.log" 2>&1; echo "fuzz rc $?"
    grep -E "fuzz: .*random cases|^E +FUZZ CASE|^FAILED|passed|failed" "$out/fuzz_w1.log" | tail -20 ;;
esac
