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
for s in dsv3 qwen3; do
  timeout 120 python3 tools/sustained.py $s --gemm --variants base,pair:MOK_WGRAD_CLUSTER=2 2>&1 | grep -E "wgrad|dense"
done
