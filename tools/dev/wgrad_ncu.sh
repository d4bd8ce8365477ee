#!/usr/bin/env bash
# One device call: ncu's speed-of-light, memory, compute and warp-state sections of mok's
# standalone wgrad gate/up kind against torch._grouped_mm's kernel for the same product, on
# SHAPE (default qwen3: 16 k-blocks per tile, where mok's wgrad is furthest from the dense
# rate).  Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONPATH=python MOK_GEMM_TIMEOUT_S=60 PYTHONUNBUFFERED=1
{ [ -f build/build.ninja ] || cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON; } >"$OUT/build.log" 2>&1
ninja -C build >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
for shape in ${SHAPE:-qwen3}; do
  timeout 200 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section LaunchStats -k "regex:grouped_wgrad|device_kernel|gemm|Gemm" --launch-skip 3 --launch-count 3 \
    python3 tools/profile_kinds.py $shape --kinds wgrad_gate_up,torch_wgrad_gate_up >"$OUT/ncu_wgrad_$shape.txt" 2>&1
  grep -E "^  [a-zA-Z_:<>]|Duration|Throughput|Pipe|Hit Rate|Registers|Shared Memory Config|Block Size|Grid Size|Stall|Warp Cycles|Issued|Eligible|Bank" \
    "$OUT/ncu_wgrad_$shape.txt" | cut -c1-150 | head -90
done
