#!/usr/bin/env bash
# One device call for the 2-CTA cluster kernels (PairStages: MOK_GEMM_CLUSTER=2,
# MOK_WGRAD_CLUSTER=2): build; their GPU tests (C++ float64 and bitwise against one CTA per
# tile, the unfused backward through the wgrad pair kernel against the fused kernel); ncu of
# the wgrad pair kernel beside the single-CTA one and torch's, with each launch's grid and
# cluster size (tools/dev/wgrad_ncu.sh); the sustained A/B of the wgrad kinds.  Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONPATH=python MOK_GEMM_TIMEOUT_S=10 PYTHONUNBUFFERED=1
{ [ -f build/build.ninja ] || cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON; } >"$OUT/build.log" 2>&1
ninja -C build >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
timeout 120 build/tests/cpp/test_gemm_gpu --gtest_filter='GemmGpu.Wgrad*:GemmGpu.PairClusters*' 2>&1 | tail -4
timeout 200 python3 -m pytest -q tests/python/test_gpu.py tests/python/test_gpu_backward.py \
  -k "pair_clusters or wgrad_cluster or grouped_wgrad" 2>&1 | tail -4
# ncu's launch statistics give each launch's grid and cluster size
SHAPE="${SHAPE:-qwen3}" bash tools/dev/wgrad_ncu.sh
# Per-instruction stall samples of the single-CTA and pair wgrad kernels (where the pair loses)
for k in wgrad_gate_up wgrad_gate_up_pair; do
  timeout 150 ncu --section WarpStateStats --section SourceCounters -k regex:grouped_wgrad --launch-skip 1 \
    --launch-count 1 -o /tmp/$k -f python3 tools/profile_kinds.py qwen3 --kinds $k >"$OUT/ncu_src_run.log" 2>&1
  ncu -i /tmp/$k.ncu-rep --page source --csv --print-source sass >/tmp/${k}_src.csv 2>>"$OUT/ncu_src_run.log"
  python3 tools/dev/ncu_source_top.py /tmp/${k}_src.csv 60 >"$OUT/src_top_$k.txt" 2>&1
  echo "== $k"; head -40 "$OUT/src_top_$k.txt"
done
for s in dsv3 qwen3; do
  timeout 120 python3 tools/sustained.py $s --gemm --variants base,pair:MOK_WGRAD_CLUSTER=2 2>&1 | grep -E "wgrad|dense"
done
