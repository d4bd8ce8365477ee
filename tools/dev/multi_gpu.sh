#!/usr/bin/env bash
# One device call on a machine of 2, 4 or 8 GPUs (issue 12): build; the real-EP tests over every
# GPU (C++ EpGpu.AllGpusMatchEp1: forward and backward bitwise against EP = 1, uneven T, zipf
# with a rank of no tokens, 100 runs, a missing rank forward and backward; Python TestMultiGPU:
# four cases bitwise against EP = 1 and virtual EP, every gradient against float64, 100 runs, a
# missing rank); then bench/bench_ep.py over every BENCH.md shape, uniform and zipf, forward
# and forward + backward, against NCCL + PyTorch (autograd) and DeepEP + PyTorch where it
# imports, with mok at EP = 1 at the same per-GPU load; then the comm-SM x minibatch sweep on
# dsv3.  Logs and bench_ep.json under $OUT (at most 7 files).  One call is at most 10 minutes, so
# PARTS picks what runs (default "tests bench"; "sweep" too when there is time), SHAPES the
# bench's shapes (default all).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONPATH=python MOK_GEMM_TIMEOUT_S="${MOK_GEMM_TIMEOUT_S:-10}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$(date +%s)
nvidia-smi --query-gpu=index,name,clocks.sm --format=csv >"$OUT/gpus.txt" 2>&1
nvidia-smi topo -m >>"$OUT/gpus.txt" 2>&1
{ [ -f build/build.ninja ] || cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON; } >"$OUT/build.log" 2>&1
ninja -C build >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "== built in $(( $(date +%s) - t0 )) s; $(grep -c GPU "$OUT/gpus.txt") GPU lines"
status=0
parts=" ${PARTS:-tests bench} "
if [[ $parts == *" tests "* ]]; then
  timeout 300 build/tests/cpp/test_ep_gpu --gtest_filter='EpGpu.AllGpusMatchEp1' >"$OUT/all_gpus.log" 2>&1 || status=1
  grep -E "EP=|backward EP|timeout message|OK \]|FAILED|SKIPPED|Failure" "$OUT/all_gpus.log" | cut -c1-200 | head -30
  timeout 400 python3 -m pytest -q -rs tests/python/test_ep.py -k "TestMultiGPU" 2>&1 | tee "$OUT/pytest_multi.log" | tail -6
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [[ $parts == *" bench "* ]]; then
  echo "== bench_ep (t = $(( $(date +%s) - t0 )) s)"
  timeout 480 python3 bench/bench_ep.py --shapes "${SHAPES:-all}" --routing uniform,zipf --out /tmp/bench_ep \
    >"$OUT/bench_ep.log" 2>&1 || status=1
  cp /tmp/bench_ep/bench_ep.json "$OUT/" 2>/dev/null
  sed -n '/^group/,$p' "$OUT/bench_ep.log" | head -40
fi
if [[ $parts == *" sweep "* ]]; then
  timeout 480 python3 bench/bench_ep.py --shapes dsv3 --routing uniform --sweep --fwd-only --out /tmp/bench_sweep \
    >"$OUT/bench_ep_sweep.log" 2>&1 || status=1
  sed -n '/^mok sweep/,$p' "$OUT/bench_ep_sweep.log" | head -30
fi
echo "== done in $(( $(date +%s) - t0 )) s, status $status"
exit $status
