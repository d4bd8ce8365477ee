#!/usr/bin/env bash
# One device call for where the fused backward's time goes now (session 13): build; the timing
# ring of the fused backward on SHAPES (default "dsv3 qwen3"), ring for every routed row, after
# 30 warm calls; the GEMM kinds at the sustained clock (dsv3); the sustained backward
# (--explore, dsv3); ncu's per-instruction stall samples of the fused backward (NCU=1).
# Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONPATH=python MOK_GEMM_TIMEOUT_S="${MOK_GEMM_TIMEOUT_S:-10}" PYTHONUNBUFFERED=1
t0=$(date +%s)
{ [ -f build/build.ninja ] || cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON; } >"$OUT/build.log" 2>&1
ninja -C build >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "== built in $(( $(date +%s) - t0 )) s"
for shape in ${SHAPES:-dsv3 qwen3}; do
  timeout 120 python3 tools/trace_forward.py $shape --backward --ring-all --warm 30 --out "$OUT" 2>&1 | tee "$OUT/trace_$shape.log" | grep -v "^wrote"
done
[ "${GEMM:-1}" = 1 ] && timeout 200 python3 tools/sustained.py dsv3 --gemm 2>&1 | tee "$OUT/gemm_dsv3.log" | tail -14
[ "${BWD:-1}" = 1 ] && timeout 200 python3 tools/sustained.py dsv3 --backward --explore 2>&1 | tee "$OUT/bwd_dsv3.log" | tail -28
if [ "${NCU:-1}" = 1 ]; then
  timeout 240 ncu --section WarpStateStats --section SourceCounters -k regex:fused_backward --launch-skip 1 \
    --launch-count 1 -o /tmp/fb -f python3 tools/dev/profile_fused_bwd.py dsv3 >"$OUT/ncu_run.log" 2>&1
  ncu -i /tmp/fb.ncu-rep --page source --csv --print-source sass >/tmp/fb_src.csv 2>>"$OUT/ncu_run.log"
  python3 tools/dev/ncu_source_top.py /tmp/fb_src.csv 80 >"$OUT/fb_source_top.txt" 2>&1
  head -40 "$OUT/fb_source_top.txt"
fi
echo "== done in $(( $(date +%s) - t0 )) s"
