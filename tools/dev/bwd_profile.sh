#!/usr/bin/env bash
# One device call to see where the fused backward's time goes: build, the timing ring of one
# dsv3 backward (tools/trace_forward.py --backward, after warm calls), ncu's warp-state and
# speed-of-light sections on the fused backward kernel and on the dgrad-down kinds.  Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOK_GEMM_TIMEOUT_S="${MOK_GEMM_TIMEOUT_S:-60}"
{ [ -f build/build.ninja ] || cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON; } >"$OUT/build.log" 2>&1
ninja -C build >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "== built"
export PYTHONPATH=python
for shape in ${SHAPES:-dsv3}; do
  timeout 120 python3 tools/trace_forward.py $shape --backward --warm 30 --out "$OUT" 2>&1 | tail -40
done
NCU_SECTIONS="--section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
timeout 200 ncu $NCU_SECTIONS --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -k regex:fused_backward --launch-skip 1 --launch-count 1 \
  python3 tools/dev/profile_fused_bwd.py dsv3 >"$OUT/ncu_fused_bwd.txt" 2>&1
echo "ncu fused: rc=$?"
grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc A|L2 Hit|Stall|stall" "$OUT/ncu_fused_bwd.txt" | head -30
timeout 150 ncu $NCU_SECTIONS --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  -k regex:grouped --launch-skip 2 --launch-count 2 python3 tools/profile_kinds.py dsv3 --kinds dgrad_down,dgrad_down_swiglu \
  >"$OUT/ncu_kinds.txt" 2>&1
echo "ncu kinds: rc=$?"
