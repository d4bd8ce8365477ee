#!/usr/bin/env bash
# One device call for the fused backward while it is new: build, its C++ EP tests, the
# fused == unfused and EP tests, the sustained backward (SHAPES, default dsv3; EXPLORE=1 adds
# the knob variants), then compute-sanitizer on the small virtual EP = 4 backward
# (SANITIZE="memcheck racecheck" by default; "none" skips).  Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOK_GEMM_TIMEOUT_S="${MOK_GEMM_TIMEOUT_S:-5}"
{ [ -f build/build.ninja ] || cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON; } >"$OUT/build.log" 2>&1
ninja -C build >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "== built"
timeout 120 build/tests/cpp/test_ep_gpu --gtest_filter='EpGpu.Backward*:EpGpu.SanitizerSmallBackward' 2>&1 | tail -12
timeout 240 env PYTHONPATH=python python3 -m pytest -q -x tests/python/test_gpu_backward.py ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tail -12
timeout 150 env PYTHONPATH=python python3 -m pytest -q -x tests/python/test_ep.py -k backward 2>&1 | tail -8
if [ "${SUSTAINED:-1}" = 1 ]; then
  for shape in ${SHAPES:-dsv3}; do
    timeout 200 env PYTHONPATH=python python3 tools/sustained.py $shape --backward ${EXPLORE:+--explore} 2>&1 | tail -26
  done
fi
for tool in ${SANITIZE:-memcheck racecheck}; do
  [ "$tool" = none ] && continue
  timeout 150 compute-sanitizer --tool $tool --print-limit 10 build/tests/cpp/test_ep_gpu \
    --gtest_filter=EpGpu.SanitizerSmallBackward >"$OUT/sanitizer_$tool.log" 2>&1
  echo "$tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log")"
done
