#!/usr/bin/env bash
# One device call for an A/B of the fused backward's knobs (session 13): build; the SASS spill
# counts of the fused kernels; the knob test cases; the sustained backward
# with --explore on SHAPES (default "dsv3 qwen3"); optionally (PROFILE=1) ncu's per-instruction
# stall samples of the fused backward with ENV_PROFILE (e.g. "MOK_TILE_N_GROUP=4").  Logs under
# $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONPATH=python MOK_GEMM_TIMEOUT_S="${MOK_GEMM_TIMEOUT_S:-10}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$(date +%s)
{ [ -f build/build.ninja ] || cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON; } >"$OUT/build.log" 2>&1
ninja -C build >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "== built in $(( $(date +%s) - t0 )) s"
cuobjdump -sass build/lib/libmok.so >/tmp/all.sass 2>/dev/null
for inst in "fused_backward_kernel" "fused_forward_kernel"; do
  python3 tools/dev/sass_of.py "$inst" </tmp/all.sass >/tmp/one.sass
  echo "$inst: $(grep -c '/\*[0-9a-f]*\*/' /tmp/one.sass) instr, STL $(grep -c STL /tmp/one.sass), LDL $(grep -c LDL /tmp/one.sass), HGMMA $(grep -c HGMMA /tmp/one.sass)"
  grep -n -B4 -A2 "STL\|LDL" /tmp/one.sass | cut -c1-110 >"$OUT/spills_${inst//[<>]/_}.txt"
done
if [ "${TESTS:-1}" = 1 ]; then
  timeout 200 python3 -m pytest -q -x tests/python/test_gpu_backward.py ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tail -6
  timeout 120 build/tests/cpp/test_gemm_gpu --gtest_filter='ForwardGpu.FusedEqualsUnfused*' 2>&1 | tail -4
fi
for shape in ${SHAPES:-dsv3 qwen3}; do
  timeout 240 python3 tools/sustained.py $shape --backward ${EXPLORE---explore} 2>&1 | tee "$OUT/sustained_$shape.log" | tail -32
done
if [ "${PROFILE:-0}" = 1 ]; then
  timeout 300 env $ENV_PROFILE ncu --section WarpStateStats --section SourceCounters -k regex:fused_backward --launch-skip 1 \
    --launch-count 1 -o /tmp/fb -f python3 tools/dev/profile_fused_bwd.py dsv3 >"$OUT/ncu_run.log" 2>&1
  ncu -i /tmp/fb.ncu-rep --page source --csv --print-source sass >/tmp/fb_src.csv 2>>"$OUT/ncu_run.log"
  python3 tools/dev/ncu_source_top.py /tmp/fb_src.csv 80 >"$OUT/fb_source_top.txt" 2>&1
  head -30 "$OUT/fb_source_top.txt"
fi
echo "== done in $(( $(date +%s) - t0 )) s"
